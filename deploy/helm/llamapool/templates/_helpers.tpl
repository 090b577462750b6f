{{/* Names and labels, as `helm create` makes them. */}}
{{- define "llamapool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "llamapool.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "llamapool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llamapool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "llamapool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "llamapool.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "llamapool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "llamapool.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "llamapool.eppName" -}}
{{- default (printf "%s-epp" (include "llamapool.fullname" .)) .Values.inferencePool.endpointPicker.name }}
{{- end }}

{{/* The model: hf://OWNER/REPO... -> "hf:OWNER/REPO..."; pvc://CLAIM/PATH -> /models/PATH on CLAIM. */}}
{{- define "llamapool.modelPath" -}}
{{- $uri := .Values.modelArtifacts.uri }}
{{- if hasPrefix "hf://" $uri }}
{{- printf "hf:%s" (trimPrefix "hf://" $uri) }}
{{- else }}
{{- $rest := trimPrefix "pvc://" $uri }}
{{- printf "/models/%s" (regexReplaceAll "^[^/]+/" $rest "") }}
{{- end }}
{{- end }}

{{- define "llamapool.modelClaim" -}}
{{- regexReplaceAll "/.*$" (trimPrefix "pvc://" .Values.modelArtifacts.uri) "" }}
{{- end }}

{{/* Checks the schema cannot make: each names the values it is about. */}}
{{- define "llamapool.validate" -}}
{{- $d := .Values.drain }}
{{- if lt (int $d.terminationGracePeriodSeconds) (add $d.preStopSeconds $d.drainTimeoutSeconds 5 | int) }}
{{- fail (printf "drain.terminationGracePeriodSeconds (%v) must be at least drain.preStopSeconds (%v) + drain.drainTimeoutSeconds (%v) + 5: the kubelet kills the pod at the end of the grace period, whatever still runs" $d.terminationGracePeriodSeconds $d.preStopSeconds $d.drainTimeoutSeconds) }}
{{- end }}
{{- if and (eq .Values.engineType "vllm") (not .Values.metrics.vllmCompatibleNames) }}
{{- fail "engineType \"vllm\" needs metrics.vllmCompatibleNames: true (the endpoint picker would find none of vLLM's gauges)" }}
{{- end }}
{{- with .Values.kvEvents }}
{{- if and .enabled (or (eq (int .port) (int $.Values.service.port)) (eq (int .port) (int .replayPort)) (eq (int .replayPort) (int $.Values.service.port))) }}
{{- fail "kvEvents.port, kvEvents.replayPort and service.port must differ" }}
{{- end }}
{{- if and .enabled (not $.Values.modelArtifacts.name) }}
{{- fail "kvEvents.enabled needs modelArtifacts.name: the model's name in the KV events' topic and the EPP's token-producer" }}
{{- end }}
{{- end }}
{{- if and (hasPrefix "pvc://" .Values.modelArtifacts.uri) .Values.modelArtifacts.authSecretName }}
{{- fail "modelArtifacts.authSecretName is for hf:// models; modelArtifacts.uri is a pvc:// one" }}
{{- end }}
{{- end }}

{{/* The EndpointPickerConfig: llm-d-router's default scorers, with an engine config for llamapool. */}}
{{- define "llamapool.eppConfig" -}}
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: queue-scorer
  - type: kv-cache-utilization-scorer
  {{- if .Values.kvEvents.enabled }}
  # precise prefix routing: the pods' KV events (kvEvents), prompts tokenized by the pods' render endpoints
  - type: token-producer
    parameters:
      modelName: {{ .Values.modelArtifacts.name | quote }}
      vllm:
        url: http://{{ include "llamapool.fullname" . }}:{{ int .Values.service.port }}
  - type: endpoint-notification-source
  - type: precise-prefix-cache-producer
    parameters:
      tokenProcessorConfig:
        blockSize: {{ int .Values.kvEvents.blockSize }}
      kvEventsConfig:
        topicFilter: "kv@"
        discoverPods: true
        podDiscoveryConfig:
          socketPort: {{ int .Values.kvEvents.port }}
          {{- if .Values.kvEvents.replayPort }}
          replaySocketPort: {{ int .Values.kvEvents.replayPort }}
          {{- end }}
  - type: prefix-cache-scorer
    parameters:
      prefixMatchInfoProducerName: precise-prefix-cache-producer
  {{- else }}
  - type: prefix-cache-scorer
  {{- end }}
  - type: metrics-data-source
    parameters:
      scheme: http
      path: /metrics
  - type: core-metrics-extractor
    parameters:
      defaultEngine: {{ .Values.engineType }}
      engineConfigs:
        - name: llamapool
          queuedRequestsSpec: "llamapool:num_requests_waiting"
          runningRequestsSpec: "llamapool:num_requests_running"
          kvUsageSpec: "llamapool:kv_cache_usage_perc"
          cacheInfoSpec: "llamapool:cache_config_info"
          cacheBlockSizeLabelName: block_size
          cacheNumBlocksLabelName: num_gpu_blocks
{{- if .Values.kvEvents.enabled }}
dataLayer:
  sources:
    - pluginRef: metrics-data-source
      extractors:
        - pluginRef: core-metrics-extractor
    - pluginRef: endpoint-notification-source  # pods come and go: a KV-events subscriber each
      extractors:
        - pluginRef: precise-prefix-cache-producer
{{- end }}
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: queue-scorer
        weight: 2
      - pluginRef: kv-cache-utilization-scorer
        weight: 2
      - pluginRef: prefix-cache-scorer
        weight: 3
{{- end }}
