{{/* Chart name. */}}
{{- define "conveyor.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified app name. */}}
{{- define "conveyor.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "conveyor.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "conveyor.selectorLabels" -}}
app.kubernetes.io/name: {{ include "conveyor.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "conveyor.labels" -}}
helm.sh/chart: {{ include "conveyor.chart" . }}
{{ include "conveyor.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: conveyor
{{- end -}}

{{- define "conveyor.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "conveyor.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "conveyor.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString .Values.image.tag) -}}
{{- end -}}

{{/* The existing Secret; rendering fails without it. */}}
{{- define "conveyor.secretName" -}}
{{- required "existingSecret is required: create a Secret with CONVEYOR_DATABASE_URL, CONVEYOR_MIGRATION_DATABASE_URL, CONVEYOR_REDIS_URL, CONVEYOR_JWT_SECRET, CONVEYOR_IDEMPOTENCY_KEYS and CONVEYOR_ENCRYPTION_KEY, then pass --set existingSecret=<name>" .Values.existingSecret -}}
{{- end -}}

{{/* Secret-backed env vars shared by every long-running role. */}}
{{- define "conveyor.secretEnv" -}}
{{- $secret := include "conveyor.secretName" . -}}
{{- range list "CONVEYOR_DATABASE_URL" "CONVEYOR_REDIS_URL" "CONVEYOR_JWT_SECRET" "CONVEYOR_IDEMPOTENCY_KEYS" "CONVEYOR_ENCRYPTION_KEY" }}
- name: {{ . }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ . }}
{{- end }}
{{- end -}}

{{/* Redis key names, mirroring src/stream/keys.rs. */}}
{{- define "conveyor.streamKey" -}}
{{- printf "%s:{%s}:stream" .root.Values.config.redisPrefix .queue -}}
{{- end -}}
{{- define "conveyor.groupKey" -}}
{{- printf "%s:%s:workers" .root.Values.config.redisPrefix .queue -}}
{{- end -}}
