{{/* Names, labels and the accelerator arithmetic shared by every template. */}}

{{- define "fleetserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride -}}
{{- else if contains "fleetserve" .Release.Name -}}
{{- .Release.Name -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (.Values.nameOverride | default "fleetserve") -}}
{{- end -}}
{{- end -}}

{{- define "fleetserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Values.nameOverride | default "fleetserve" }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "fleetserve.labels" -}}
{{ include "fleetserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The Kubernetes extended resource of one accelerator ("" for CPU-only engines). */}}
{{- define "fleetserve.gpuResource" -}}
{{- $a := .Values.accelerator -}}
{{- if $a.resourceName -}}{{ $a.resourceName }}
{{- else if eq $a.type "nvidia" -}}nvidia.com/gpu
{{- else if eq $a.type "amd" -}}amd.com/gpu
{{- end -}}
{{- end -}}

{{/* Accelerators per engine pod: one engine replica per pod, tensor_parallel_size ranks. */}}
{{- define "fleetserve.gpusPerPod" -}}
{{- if include "fleetserve.gpuResource" . -}}{{ int (.Values.engine.tensor_parallel_size | default 1) }}{{- else -}}0{{- end -}}
{{- end -}}

{{/* The worker groups in use: [engine] or [prefill, decode]. */}}
{{- define "fleetserve.groupNames" -}}
{{- if .Values.pd.enabled -}}prefill,decode{{- else -}}engine{{- end -}}
{{- end -}}
