{{- define "hi.name" -}}hybrid-inference-operator{{- end -}}
{{- define "hi.fullname" -}}{{ printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- define "hi.labels" -}}
app.kubernetes.io/name: {{ include "hi.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}
{{- define "hi.selector" -}}
app.kubernetes.io/name: {{ include "hi.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
{{- define "hi.serviceAccount" -}}
{{- if .Values.serviceAccount.create }}{{ default (include "hi.fullname" .) .Values.serviceAccount.name }}{{ else }}{{ default "default" .Values.serviceAccount.name }}{{ end -}}
{{- end -}}
