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
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "conveyor.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "conveyor.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The image: repository@digest when image.digest is set, else repository:tag (tag defaults to the appVersion),
with global.imageRegistry in front when set. */}}
{{- define "conveyor.image" -}}
{{- include "conveyor.roleImage" (dict "root" . "own" dict) -}}
{{- end -}}

{{/* A role's image: its own repository, tag or digest over image's (.own: the role's image values). A role that
names its own repository names its own tag or digest too, or takes the appVersion; a role that names a tag is pulled
by that tag, never by image.digest. */}}
{{- define "conveyor.roleImage" -}}
{{- $root := .root -}}
{{- $own := .own | default dict -}}
{{- $repository := $own.repository | default $root.Values.image.repository -}}
{{- $digest := $own.digest | default (ternary "" $root.Values.image.digest (or (hasKey $own "repository") (hasKey $own "tag"))) -}}
{{- $tag := $own.tag | default (ternary "" ($root.Values.image.tag | toString) (hasKey $own "repository")) | default $root.Chart.AppVersion | toString -}}
{{- with (dig "imageRegistry" "" ($root.Values.global | default dict)) -}}
{{- $repository = printf "%s/%s" (trimSuffix "/" .) $repository -}}
{{- end -}}
{{- if $digest -}}
{{- printf "%s@%s" $repository $digest -}}
{{- else -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The port of a listen address ("0.0.0.0:8080", "[::]:8080"); rendering fails without one. */}}
{{- define "conveyor.addrPort" -}}
{{- $port := regexFind "[0-9]+$" (toString .addr) -}}
{{- if not (regexMatch ":[0-9]+$" (toString .addr)) -}}
{{- fail (printf "%s (%q) must end in :<port>" .name .addr) -}}
{{- end -}}
{{- $port -}}
{{- end -}}
{{- define "conveyor.httpPort" -}}
{{- include "conveyor.addrPort" (dict "addr" .Values.config.httpAddr "name" "config.httpAddr") -}}
{{- end -}}
{{- define "conveyor.adminPort" -}}
{{- include "conveyor.addrPort" (dict "addr" .Values.config.adminAddr "name" "config.adminAddr") -}}
{{- end -}}

{{/* The existing Secret; rendering fails without it. */}}
{{- define "conveyor.secretName" -}}
{{- required "existingSecret is required: create a Secret with CONVEYOR_DATABASE_URL, CONVEYOR_MIGRATION_DATABASE_URL, CONVEYOR_RUNTIME_DATABASE_URL, CONVEYOR_REDIS_URL, CONVEYOR_JWT_SECRET, CONVEYOR_IDEMPOTENCY_KEYS and CONVEYOR_ENCRYPTION_KEY, then pass --set existingSecret=<name>" .Values.existingSecret -}}
{{- end -}}

{{/* Secret-backed env vars shared by every long-running role. The workspace tokens' key is not among them: only the
API verifies tokens (conveyor.apiSecretEnv). */}}
{{- define "conveyor.secretEnv" -}}
{{- $secret := include "conveyor.secretName" . -}}
{{- range list "CONVEYOR_DATABASE_URL" "CONVEYOR_REDIS_URL" "CONVEYOR_IDEMPOTENCY_KEYS" "CONVEYOR_ENCRYPTION_KEY" }}
- name: {{ . }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ . }}
{{- end }}
{{- end -}}

{{/* The runtime role's URL: the dispatcher, maintenance and the worker's bookkeeping work across workspaces through
it. Every role but the API gets it (deployments.yaml), and the migrate Job, which grants it its functions. */}}
{{- define "conveyor.runtimeSecretEnv" -}}
- name: CONVEYOR_RUNTIME_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "conveyor.secretName" . }}
      key: CONVEYOR_RUNTIME_DATABASE_URL
{{- end -}}

{{/* The operator surface's keys (admin API, web UI), optional: it is off without them. Only the API serves it, so
only the API's Pods get them (deployments.yaml), and the migrate Job the operator role's URL. */}}
{{- define "conveyor.operatorSecretEnv" -}}
{{- $secret := include "conveyor.secretName" . -}}
{{- range list "CONVEYOR_OPERATOR_DATABASE_URL" "CONVEYOR_ADMIN_TOKEN" "CONVEYOR_OPERATOR_JWT_SECRET" "CONVEYOR_OPERATOR_JWT_PREVIOUS_SECRET" }}
- name: {{ . }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ . }}
      optional: true
{{- end }}
{{- end -}}

{{/* The workspace tokens' keys: only the API verifies tokens, so only the API's Pods get them (the previous key is
optional, set while a rotation lasts). */}}
{{- define "conveyor.apiSecretEnv" -}}
{{- $secret := include "conveyor.secretName" . -}}
- name: CONVEYOR_JWT_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: CONVEYOR_JWT_SECRET
- name: CONVEYOR_JWT_PREVIOUS_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: CONVEYOR_JWT_PREVIOUS_SECRET
      optional: true
{{- end -}}

{{/* The roles whose Deployment this release renders. */}}
{{- define "conveyor.enabledRoles" -}}
{{- $roles := list -}}
{{- range $role := list "api" "dispatcher" "worker" "maintenance" -}}
{{- if (index $.Values $role).enabled -}}{{- $roles = append $roles $role -}}{{- end -}}
{{- end -}}
{{- join "," $roles -}}
{{- end -}}

{{/* Redis key names, mirroring src/stream/keys.rs. */}}
{{- define "conveyor.streamKey" -}}
{{- printf "%s:{%s}:stream" .root.Values.config.redisPrefix .queue -}}
{{- end -}}
{{- define "conveyor.groupKey" -}}
{{- printf "%s:%s:workers" .root.Values.config.redisPrefix .queue -}}
{{- end -}}

{{/* NetworkPolicy peers: one namespaceSelector per namespace name, then the raw peers in `from`. */}}
{{- define "conveyor.networkPolicyPeers" -}}
{{- range .namespaces }}
- namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ . | quote }}
{{- end }}
{{- with .from }}
{{ toYaml . }}
{{- end }}
{{- end -}}
