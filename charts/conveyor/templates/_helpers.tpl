{{/* Name prefix of every object: the release name, or "conveyor" when they are equal. */}}
{{- define "conveyor.fullname" -}}
{{- if eq .Release.Name "conveyor" -}}conveyor{{- else -}}{{ printf "%s-conveyor" .Release.Name | trunc 55 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "conveyor.labels" -}}
app.kubernetes.io/part-of: conveyor
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of a component: (dict "root" $ "component" "gateway") */}}
{{- define "conveyor.selector" -}}
app.kubernetes.io/name: conveyor-{{ .component }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end -}}

{{- define "conveyor.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "conveyor.operatorSecret" -}}
{{ .Values.operator.connections.existingSecret | default (printf "%s-operator-connections" (include "conveyor.fullname" .)) }}
{{- end -}}
{{- define "conveyor.gatewaySecret" -}}
{{ .Values.gateway.connections.existingSecret | default (printf "%s-gateway-connections" (include "conveyor.fullname" .)) }}
{{- end -}}
{{- define "conveyor.tokensSecret" -}}
{{ .Values.gateway.tokens.existingSecret | default (printf "%s-gateway-tokens" (include "conveyor.fullname" .)) }}
{{- end -}}

{{/* The CA: an env var, and the volume and mount when it comes from a Secret. */}}
{{- define "conveyor.caEnv" -}}
{{- if .Values.ca.secretName }}
- name: CONVEYOR_CA_FILE
  value: /etc/conveyor/ca/ca.crt
{{- else if .Values.ca.file }}
- name: CONVEYOR_CA_FILE
  value: {{ .Values.ca.file | quote }}
{{- end }}
{{- if .Values.requireTls }}
- name: CONVEYOR_REQUIRE_TLS
  value: "true"
{{- end }}
{{- end -}}
{{- define "conveyor.caMount" -}}
{{- if .Values.ca.secretName }}
- name: ca
  mountPath: /etc/conveyor/ca
  readOnly: true
{{- end }}
{{- end -}}
{{- define "conveyor.caVolume" -}}
{{- if .Values.ca.secretName }}
- name: ca
  secret: {secretName: {{ .Values.ca.secretName }}, items: [{key: ca.crt, path: ca.crt}]}
{{- end }}
{{- end -}}

{{/* Restricted pod security: what every Conveyor container runs with. */}}
{{- define "conveyor.podSecurity" -}}
runAsNonRoot: true
runAsUser: 65532
# Volumes that support it (the gateway's archive claim) are made writable for that user.
fsGroup: 65532
seccompProfile: {type: RuntimeDefault}
{{- end -}}
{{- define "conveyor.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end -}}

{{- define "conveyor.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- /*
A digest of a Secret the pods read into their environment, as a pod annotation: when it
changes, `helm upgrade` rolls the pods (environment values are read once, at start). For a
Secret the chart makes, the digest of what it puts in; for an existing one, of its data as
the cluster holds it at install or upgrade (`helm template` sees none: a constant).
(dict "root" $ "name" <secret> "existing" <bool> "made" <values>)
*/}}
{{- define "conveyor.secretDigest" -}}
{{- if .existing -}}
{{- $found := lookup "v1" "Secret" .root.Release.Namespace .name -}}
{{- $found.data | default dict | toJson | sha256sum | trunc 16 -}}
{{- else -}}
{{- .made | toJson | sha256sum | trunc 16 -}}
{{- end -}}
{{- end -}}
