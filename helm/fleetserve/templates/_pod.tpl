{{/*
The pod template of one Ray group. Called with (list $ "head"|"engine"|"prefill"|"decode").
Engine groups get the accelerators (tensor_parallel_size per pod), a default toleration
for the accelerator taint, the model volume and credentials; the head gets neither.
*/}}
{{- define "fleetserve.podTemplate" -}}
{{- $root := index . 0 -}}{{- $kind := index . 1 -}}
{{- $v := $root.Values -}}
{{- $isHead := eq $kind "head" -}}
{{- $g := ternary $v.head (index $v.workers $kind) $isHead -}}
{{- $gpuRes := include "fleetserve.gpuResource" $root -}}
{{- $gpus := int (include "fleetserve.gpusPerPod" $root) -}}
metadata:
  labels:
    {{- include "fleetserve.selectorLabels" $root | nindent 4 }}
    fleetserve.io/pool: {{ $kind }}
    {{- with $g.labels }}{{ toYaml . | nindent 4 }}{{ end }}
  {{- with $g.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if $g.tolerations }}
  tolerations:
    {{- toYaml $g.tolerations | nindent 4 }}
  {{- else if and (not $isHead) $gpuRes }}
  tolerations:
    - key: {{ $gpuRes }}
      operator: Exists
      effect: NoSchedule
  {{- end }}
  {{- with $g.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $g.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  containers:
    - name: {{ ternary "ray-head" "ray-worker" $isHead }}
      image: {{ printf "%s:%s" $v.image.repository $v.image.tag | quote }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- $res := deepCopy ($g.resources | default dict) }}
      {{- if and (not $isHead) $gpuRes }}
      {{- $limits := $res.limits | default dict }}{{- $_ := set $limits $gpuRes $gpus }}{{- $_ := set $res "limits" $limits }}
      {{- $requests := $res.requests | default dict }}{{- $_ := set $requests $gpuRes $gpus }}{{- $_ := set $res "requests" $requests }}
      {{- end }}
      {{- with $res }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      ports:
        - {name: serve, containerPort: {{ $v.service.httpPort }}}
        {{- if $v.service.grpc }}
        - {name: grpc, containerPort: {{ $v.service.grpcPort }}}
        {{- end }}
        - {name: metrics, containerPort: 8080}
        {{- if $isHead }}
        - {name: gcs-server, containerPort: 6379}
        - {name: dashboard, containerPort: 8265}
        - {name: client, containerPort: 10001}
        {{- end }}
      {{- $env := list }}
      {{- if $v.auth.apiKeySecret.name }}
      {{- $env = append $env (dict "name" "FLEETSERVE_API_KEY" "valueFrom" (dict "secretKeyRef" (dict "name" $v.auth.apiKeySecret.name "key" $v.auth.apiKeySecret.key))) }}
      {{- end }}
      {{- $env = concat $env ($g.env | default list) }}
      {{- with $env }}
      env:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $envFrom := $g.envFrom | default list }}
      {{- if and (not $isHead) $v.modelCredentials.secretName }}
      {{- $envFrom = append $envFrom (dict "secretRef" (dict "name" $v.modelCredentials.secretName)) }}
      {{- end }}
      {{- with $envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- include "fleetserve.probes" (list $root $isHead) | nindent 6 }}
      volumeMounts:
        - {name: dshm, mountPath: /dev/shm}
        {{- if and (not $isHead) (eq $v.model.source "pvc") }}
        - name: model
          mountPath: {{ $v.model.pvc.mountPath }}
          readOnly: {{ $v.model.pvc.readOnly }}
        {{- end }}
        {{- with $g.volumeMounts }}{{ toYaml . | nindent 8 }}{{ end }}
  volumes:
    # Shared memory for Ray's object store and torch (the container default is 64 MiB).
    - name: dshm
      emptyDir:
        medium: Memory
        {{- with $g.shmSize }}
        sizeLimit: {{ . }}
        {{- end }}
    {{- if and (not $isHead) (eq $v.model.source "pvc") }}
    - name: model
      persistentVolumeClaim:
        claimName: {{ $v.model.pvc.claimName }}
        readOnly: {{ $v.model.pvc.readOnly }}
    {{- end }}
    {{- with $g.volumes }}{{ toYaml . | nindent 4 }}{{ end }}
{{- end -}}

{{/*
Probes. Engine pods: a startup probe on the app's /health through the pod's own Serve
proxy, allowed probes.modelLoadSeconds (the model loads before anything can serve), so
liveness checks cannot restart a pod that is still loading; afterwards liveness is the
raylet's health (a slow request never restarts a pod) and readiness the app's /health.
The head: GCS + raylet health, readiness on its Serve proxy.
*/}}
{{- define "fleetserve.probes" -}}
{{- $root := index . 0 -}}{{- $isHead := index . 1 -}}
{{- $p := $root.Values.probes -}}
{{- $raylet := "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success" -}}
{{- $gcs := "wget -T 2 -q -O- http://localhost:8265/api/gcs_healthz | grep success" -}}
{{- $alive := ternary (printf "%s && %s" $raylet $gcs) $raylet $isHead -}}
{{- if $isHead }}
startupProbe:
  exec: {command: [bash, -c, {{ $alive | quote }}]}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: 30
readinessProbe:
  httpGet: {path: /-/healthz, port: serve}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: 3
{{- else }}
startupProbe:
  httpGet: {path: /health, port: serve}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: 5
  failureThreshold: {{ div (add $p.modelLoadSeconds $p.periodSeconds -1) $p.periodSeconds }}
readinessProbe:
  httpGet: {path: /health, port: serve}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: 5
  failureThreshold: 3
{{- end }}
livenessProbe:
  exec: {command: [bash, -c, {{ $alive | quote }}]}
  periodSeconds: 15
  timeoutSeconds: 5
  failureThreshold: 5
{{- end -}}
