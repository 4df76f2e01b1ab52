{{/*
The ONE place where chart values become fleetserve app-config keys (cluster/config.py's
AppConfig; P/D and placement keys: cluster/placement.py). The result is the same document
`fleetserve build app.yaml` writes: a Ray Serve deploy config whose application `args` is
the app config. When the app config's shape changes (e.g. the P/D keys), change it here.
*/}}

{{- define "fleetserve.placement" -}}
{{- $root := index . 0 -}}{{- $pool := index . 1 -}}
{{- $gpus := int (include "fleetserve.gpusPerPod" $root) -}}
{{- $p := dict "label_selector" (dict "fleetserve.io/pool" $pool) -}}
{{- /* TP=1: the replica's actor holds the GPU; TP>1: its TP workers reserve them. */ -}}
{{- if eq $gpus 1 -}}{{- $_ := set $p "num_gpus" 1 -}}{{- end -}}
{{- toYaml $p -}}
{{- end -}}

{{- define "fleetserve.modelName" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "registry" -}}{{ $m.name }}
{{- else if eq $m.source "image" -}}{{ $m.path }}
{{- else -}}{{ if $m.path }}{{ printf "%s/%s" (trimSuffix "/" $m.pvc.mountPath) (trimPrefix "/" $m.path) }}{{ else }}{{ $m.pvc.mountPath }}{{ end }}
{{- end -}}
{{- end -}}

{{- define "fleetserve.appConfig" -}}
{{- $v := .Values -}}
{{- $engine := deepCopy $v.engine -}}
{{- $_ := set $engine "model" (include "fleetserve.modelName" .) -}}
{{- if $v.model.servedModelName -}}{{- $_ := set $engine "served_model_name" $v.model.servedModelName -}}{{- end -}}
{{- $app := dict "name" $v.app.name "engine" $engine "routing_policy" $v.app.routingPolicy
      "num_cpus_per_replica" $v.app.numCpusPerReplica
      "http" (dict "host" "0.0.0.0" "port" $v.service.httpPort "max_body_bytes" $v.app.httpMaxBodyBytes)
      "grpc" (dict "enabled" $v.service.grpc "port" $v.service.grpcPort) -}}
{{- if $v.app.routing -}}{{- $_ := set $app "routing" $v.app.routing -}}{{- end -}}
{{- if $v.app.allowRuntimeLoraUpdating -}}{{- $_ := set $app "allow_runtime_lora_updating" true -}}{{- end -}}
{{- if $v.app.tracing -}}{{- $_ := set $app "tracing" $v.app.tracing -}}{{- end -}}
{{- if $v.app.slo -}}{{- $_ := set $app "slo" $v.app.slo -}}{{- end -}}
{{- if $v.auth.apiKeySecret.name -}}{{- $_ := set $app "api_key_env" "FLEETSERVE_API_KEY" -}}{{- end -}}
{{- if $v.pd.enabled -}}
  {{- $pools := dict "enabled" true "connector" $v.pd.connector -}}
  {{- range $pool := list "prefill" "decode" -}}
  {{- $_ := set $pools $pool (dict "num_replicas" (index $v.workers $pool).replicas
        "placement" (include "fleetserve.placement" (list $ $pool) | fromYaml)) -}}
  {{- end -}}
  {{- $_ := set $app "pd" $pools -}}
{{- else -}}
  {{- $_ := set $app "placement" (include "fleetserve.placement" (list $ "engine") | fromYaml) -}}
  {{- if $v.autoscaling.enabled -}}
  {{- $a := $v.autoscaling -}}
  {{- $_ := set $app "autoscaling" (dict "min_replicas" $a.minReplicas "max_replicas" $a.maxReplicas
        "target_ongoing_requests" $a.targetOngoingRequests "upscale_delay_s" $a.upscaleDelaySeconds
        "downscale_delay_s" $a.downscaleDelaySeconds) -}}
  {{- else -}}
  {{- $_ := set $app "num_replicas" $v.workers.engine.replicas -}}
  {{- end -}}
{{- end -}}
{{- toYaml $app -}}
{{- end -}}

{{- define "fleetserve.serveConfig" -}}
{{- $v := .Values -}}
{{- $doc := dict "proxy_location" "EveryNode"
      "http_options" (dict "host" "0.0.0.0" "port" $v.service.httpPort)
      "logging_config" (dict "enable_access_log" false) -}}
{{- if $v.service.grpc -}}
{{- $_ := set $doc "grpc_options" (dict "port" $v.service.grpcPort "grpc_servicer_functions"
      (list "fleetserve.router.grpc.service.add_servicer")) -}}
{{- end -}}
{{- $_ := set $doc "applications" (list (dict "name" $v.app.name "route_prefix" "/"
      "import_path" "fleetserve.cluster.serve_app:app_builder"
      "args" (include "fleetserve.appConfig" . | fromYaml))) -}}
{{- toYaml $doc -}}
{{- end -}}
