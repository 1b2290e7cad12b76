{{- define "kvmesh.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvmesh.labels" -}}
app.kubernetes.io/name: kvmesh
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvmesh.selectorLabels" -}}
app.kubernetes.io/name: kvmesh
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvmesh.serviceAccountName" -}}
{{- default (include "kvmesh.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* Labels of chart objects that are not the operator itself (monitors, dashboard, policies). */}}
{{- define "kvmesh.commonLabels" -}}
app.kubernetes.io/name: kvmesh
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/*
Which children a ServiceMonitor/PodMonitor selects: the engine and router objects the
operator renders (operator/render.py labels()), nothing else with kvmesh's name.
*/}}
{{- define "kvmesh.metricsSelector" -}}
matchLabels:
  app.kubernetes.io/name: kvmesh
  app.kubernetes.io/managed-by: kvmesh-operator
matchExpressions:
  - key: app.kubernetes.io/component
    operator: In
    values:
      {{- toYaml .Values.metrics.components | nindent 6 }}
{{- end -}}

{{/* namespaceSelector of a monitor: its own value, else watchNamespaces, else any namespace. */}}
{{- define "kvmesh.metricsNamespaceSelector" -}}
{{- $monitor := index . 0 -}}
{{- $root := index . 1 -}}
{{- if $monitor.namespaceSelector -}}
{{- toYaml $monitor.namespaceSelector -}}
{{- else if $root.Values.watchNamespaces -}}
matchNames:
  {{- toYaml $root.Values.watchNamespaces | nindent 2 }}
{{- else -}}
any: true
{{- end -}}
{{- end -}}

{{/*
Target relabelings shared by both monitors: model_deployment and component labels from
the pod's labels, so the dashboard can filter by ModelDeployment; then the user's own.
*/}}
{{- define "kvmesh.metricsRelabelings" -}}
- action: replace
  sourceLabels: [__meta_kubernetes_pod_label_kvmesh_io_model_deployment]
  targetLabel: model_deployment
- action: replace
  sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_component]
  targetLabel: component
{{- with .relabelings }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kvmesh.metricsCheck" -}}
{{- if and .Values.metrics.serviceMonitor.enabled .Values.metrics.podMonitor.enabled -}}
{{- fail "metrics.serviceMonitor.enabled and metrics.podMonitor.enabled are both true: each pod would be scraped twice and every sum on the dashboard doubled; enable one" -}}
{{- end -}}
{{- end -}}
