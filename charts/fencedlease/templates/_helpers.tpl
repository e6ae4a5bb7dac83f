{{/* Names and labels shared by the templates. */}}

{{/* The chart's short name. */}}
{{- define "fencedlease.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* "<release>-<name>", or the release name alone when it already contains the name. */}}
{{- define "fencedlease.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "fencedlease.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "fencedlease.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fencedlease.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fencedlease.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels on every object the chart renders. */}}
{{- define "fencedlease.labels" -}}
{{ include "fencedlease.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: fencedlease
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ include "fencedlease.chart" . }}
{{- end -}}

{{- define "fencedlease.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "fencedlease.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name must name an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The webhook Service; the serving certificate is for its DNS names. */}}
{{- define "fencedlease.serviceName" -}}
{{- include "fencedlease.fullname" . -}}
{{- end -}}

{{/* The Secret (type kubernetes.io/tls) holding tls.crt, tls.key and ca.crt. */}}
{{- define "fencedlease.certSecretName" -}}
{{- printf "%s-tls" (include "fencedlease.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fencedlease.certificateName" -}}
{{- printf "%s-serving" (include "fencedlease.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fencedlease.issuerName" -}}
{{- printf "%s-selfsigned" (include "fencedlease.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Cluster-scoped webhook configurations: named after the release, so releases do not clash. */}}
{{- define "fencedlease.validatingName" -}}
{{- printf "%s-fencing" (include "fencedlease.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fencedlease.mutatingName" -}}
{{- printf "%s-injection" (include "fencedlease.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Comma-separated names of the webhook configurations whose caBundle the operator keeps. */}}
{{- define "fencedlease.webhookConfigurations" -}}
{{- $names := list (include "fencedlease.validatingName" .) -}}
{{- if .Values.injection.enabled -}}
{{- $names = append $names (include "fencedlease.mutatingName" .) -}}
{{- end -}}
{{- join "," $names -}}
{{- end -}}

{{- define "fencedlease.electionLease" -}}
{{- default (printf "%s-controller" (include "fencedlease.fullname" .) | trunc 63 | trimSuffix "-") .Values.controller.electionLease -}}
{{- end -}}

{{- define "fencedlease.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Fails rendering early, with a message, on combinations the schema cannot express. */}}
{{- define "fencedlease.validate" -}}
{{- if and .Values.certManager.enabled (not (.Capabilities.APIVersions.Has "cert-manager.io/v1")) -}}
{{- fail "certManager.enabled is true but the cluster has no cert-manager.io/v1 API: install cert-manager first, or leave certManager.enabled false to let the operator manage its certificate (with `helm template`, pass --api-versions cert-manager.io/v1)" -}}
{{- end -}}
{{- range .Values.fencing.resources -}}
{{- if or (eq .group "fencedlease.io") (eq .group "*") -}}
{{- fail (printf "fencing.resources: group %q is not allowed: the webhook must never be on the path of FencedLease writes (renewals)" .group) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Environment of both containers: the downward API gives identity and namespace. */}}
{{- define "fencedlease.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: RUST_LOG
  value: {{ .Values.logLevel | quote }}
{{- end -}}

{{- define "fencedlease.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
privileged: false
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}
