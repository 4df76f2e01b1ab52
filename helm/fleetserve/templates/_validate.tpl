{{/*
Cross-field rules the schema cannot express, and KubeRay's operator-side rules (which an
API server would not check: the operator would reject the RayService later, after
`helm install` reported success). Each `fail`s naming the values key.
*/}}
{{- define "fleetserve.validate" -}}
{{- $v := .Values -}}
{{- $name := include "fleetserve.fullname" . -}}
{{- if gt (len $name) 47 -}}
{{- fail (printf "fullnameOverride/release name: the RayService name %q is %d characters; KubeRay allows at most 47" $name (len $name)) -}}
{{- end -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) -}}
{{- fail (printf "fullnameOverride/release name: the RayService name %q must be a DNS-1035 label (lower-case letters, digits, '-', starting with a letter)" $name) -}}
{{- end -}}
{{- if hasKey $v.engine "model" -}}
{{- fail "engine.model: set the model with model.name (model.source: registry), model.path (image) or model.pvc (pvc)" -}}
{{- end -}}
{{- if hasKey $v.engine "served_model_name" -}}
{{- fail "engine.served_model_name: use model.servedModelName" -}}
{{- end -}}
{{- if and (eq $v.model.source "image") (not $v.model.path) -}}
{{- fail "model.path: required with model.source=image (where the weights are in the image)" -}}
{{- end -}}
{{- if and (eq $v.model.source "pvc") (not $v.model.pvc.claimName) -}}
{{- fail "model.pvc.claimName: required with model.source=pvc" -}}
{{- end -}}
{{- if and (eq $v.model.source "registry") (not $v.model.name) -}}
{{- fail "model.name: required with model.source=registry" -}}
{{- end -}}
{{- $gpuRes := include "fleetserve.gpuResource" . -}}
{{- $gpus := int (include "fleetserve.gpusPerPod" .) -}}
{{- $tp := int ($v.engine.tensor_parallel_size | default 1) -}}
{{- if $gpuRes -}}
{{- range $res := list $v.head.resources.limits $v.head.resources.requests -}}
{{- if and $res (hasKey $res $gpuRes) -}}
{{- fail (printf "head.resources: the head serves no model; remove %s from it" $gpuRes) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $k := list "num-gpus" "num-cpus" -}}
{{- if hasKey $v.head.rayStartParams $k -}}
{{- fail (printf "head.rayStartParams.%s: fixed to \"0\" by the chart (the head serves no model)" $k) -}}
{{- end -}}
{{- end -}}
{{- range $kind := splitList "," (include "fleetserve.groupNames" .) -}}
{{- $g := index $v.workers $kind -}}
{{- $key := printf "workers.%s" $kind -}}
{{- if and $gpuRes (hasKey $g "gpus") (ne (int $g.gpus) $tp) -}}
{{- fail (printf "%s.gpus: %d accelerators per pod, but engine.tensor_parallel_size is %d (one engine replica per pod uses exactly tensor_parallel_size %s)" $key (int $g.gpus) $tp $gpuRes) -}}
{{- end -}}
{{- if and (not $gpuRes) (hasKey $g "gpus") (gt (int $g.gpus) 0) -}}
{{- fail (printf "%s.gpus: accelerator.type is none (CPU-only engines); set it to 0 or remove it" $key) -}}
{{- end -}}
{{- range $which := list "limits" "requests" -}}
{{- $r := index ($g.resources | default dict) $which | default dict -}}
{{- if and $gpuRes (hasKey $r $gpuRes) (ne (int (index $r $gpuRes)) $tp) -}}
{{- fail (printf "%s.resources.%s.%s: %v, but engine.tensor_parallel_size is %d (the chart derives it; remove it)" $key $which $gpuRes (index $r $gpuRes) $tp) -}}
{{- end -}}
{{- end -}}
{{- if hasKey $g.rayStartParams "num-gpus" -}}
{{- fail (printf "%s.rayStartParams.num-gpus: derived from engine.tensor_parallel_size and accelerator; remove it" $key) -}}
{{- end -}}
{{- if hasKey $g.rayStartParams "labels" -}}
{{- fail (printf "%s.rayStartParams.labels: KubeRay takes Ray node labels from the group's labels field, not rayStartParams (the chart sets fleetserve.io/pool)" $key) -}}
{{- end -}}
{{- if not (and (eq $kind "engine") $v.autoscaling.enabled) -}}
{{- if gt (int $g.minReplicas) (int $g.maxReplicas) -}}
{{- fail (printf "%s.minReplicas (%d) must be <= %s.maxReplicas (%d)" $key (int $g.minReplicas) $key (int $g.maxReplicas)) -}}
{{- end -}}
{{- if or (lt (int $g.replicas) (int $g.minReplicas)) (gt (int $g.replicas) (int $g.maxReplicas)) -}}
{{- fail (printf "%s.replicas (%d) must be within minReplicas..maxReplicas (%d..%d)" $key (int $g.replicas) (int $g.minReplicas) (int $g.maxReplicas)) -}}
{{- end -}}
{{- if lt (int $g.replicas) 1 -}}
{{- fail (printf "%s.replicas: at least 1 engine pod (or set autoscaling.enabled)" $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $v.autoscaling.enabled -}}
{{- if $v.pd.enabled -}}
{{- fail "autoscaling.enabled: not supported with pd.enabled; size workers.prefill.replicas and workers.decode.replicas" -}}
{{- end -}}
{{- if gt (int $v.autoscaling.minReplicas) (int $v.autoscaling.maxReplicas) -}}
{{- fail (printf "autoscaling.minReplicas (%d) must be <= autoscaling.maxReplicas (%d)" (int $v.autoscaling.minReplicas) (int $v.autoscaling.maxReplicas)) -}}
{{- end -}}
{{- end -}}
{{- $u := $v.upgradeStrategy -}}
{{- if eq $u.type "NewClusterWithIncrementalUpgrade" -}}
{{- $o := $u.clusterUpgradeOptions -}}
{{- if not $v.autoscaling.enabled -}}
{{- fail "upgradeStrategy.type=NewClusterWithIncrementalUpgrade: KubeRay needs the in-tree autoscaler; set autoscaling.enabled=true" -}}
{{- end -}}
{{- if not $o.gatewayClassName -}}
{{- fail "upgradeStrategy.clusterUpgradeOptions.gatewayClassName: required by NewClusterWithIncrementalUpgrade (a Gateway API class in the cluster)" -}}
{{- end -}}
{{- if not (and (gt (int $o.stepSizePercent) 0) (le (int $o.stepSizePercent) (int $o.maxSurgePercent)) (le (int $o.maxSurgePercent) 100)) -}}
{{- fail (printf "upgradeStrategy.clusterUpgradeOptions: KubeRay needs 0 < stepSizePercent (%d) <= maxSurgePercent (%d) <= 100" (int $o.stepSizePercent) (int $o.maxSurgePercent)) -}}
{{- end -}}
{{- if le (int $o.intervalSeconds) 0 -}}
{{- fail "upgradeStrategy.clusterUpgradeOptions.intervalSeconds: must be > 0" -}}
{{- end -}}
{{- end -}}
{{- end -}}
