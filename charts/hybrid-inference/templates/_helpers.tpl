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
{{/* Target labels of pipeline pods: pipeline (instance), stage (index), stage_name, replica (pod index). */}}
{{- define "hi.stageRelabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_label_hybrid_inference_dev_instance]
  targetLabel: pipeline
- sourceLabels: [__meta_kubernetes_pod_label_hybrid_inference_dev_stage_index]
  targetLabel: stage
- sourceLabels: [__meta_kubernetes_pod_label_hybrid_inference_dev_stage]
  targetLabel: stage_name
- sourceLabels: [__meta_kubernetes_pod_label_apps_kubernetes_io_pod_index]
  targetLabel: replica
{{- end -}}
