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

{{/*
The operator runs as two Deployments with a ServiceAccount each: the controller (elected, writes
FencedLeases, pod labels, the certificate) and the network-facing webhook (reads only). A pod
has one ServiceAccount, so the two could not be given different rights in one pod.
Pods of one component: (dict "root" $ "component" "controller"|"webhook").
*/}}
{{- define "fencedlease.componentSelectorLabels" -}}
{{ include "fencedlease.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "fencedlease.controllerName" -}}
{{- printf "%s-controller" (include "fencedlease.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fencedlease.webhookName" -}}
{{- printf "%s-webhook" (include "fencedlease.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Pods of each Deployment: its own value, else the shared `replicas`. */}}
{{- define "fencedlease.controllerReplicas" -}}
{{- default .Values.replicas .Values.controller.replicas -}}
{{- end -}}

{{- define "fencedlease.webhookReplicas" -}}
{{- default .Values.replicas .Values.webhook.replicas -}}
{{- end -}}

{{/* Whether the chart creates the webhook's ServiceAccount (webhook.serviceAccount.create, default true). */}}
{{- define "fencedlease.webhookServiceAccountCreate" -}}
{{- if dig "serviceAccount" "create" true .Values.webhook -}}true{{- end -}}
{{- end -}}

{{- define "fencedlease.webhookServiceAccountName" -}}
{{- $name := dig "serviceAccount" "name" "" .Values.webhook -}}
{{- if include "fencedlease.webhookServiceAccountCreate" . -}}
{{- default (include "fencedlease.webhookName" .) $name -}}
{{- else -}}
{{- required "webhook.serviceAccount.name must name an existing ServiceAccount when webhook.serviceAccount.create is false" $name -}}
{{- end -}}
{{- end -}}

{{/* Role and RoleBinding of one entry of `workloads`: (dict "root" $ "serviceAccount" NAME). */}}
{{- define "fencedlease.workloadRoleName" -}}
{{- printf "%s-%s" (include "fencedlease.fullname" .root) .serviceAccount -}}
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

{{/* The fencing ValidatingAdmissionPolicy (policy mode); the controller names it in the bindings
it keeps. A DNS label (no dots): the controller refuses other names. */}}
{{- define "fencedlease.policyName" -}}
{{- printf "%s-fencing" (include "fencedlease.fullname" .) | replace "." "-" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /*
The subresources of one fencing.resources entry that carry the object itself, judged like it:
/status, and for pods /ephemeralcontainers and /resize (a pod's own metadata comes with them).
The chart's side of the one table of judged subresources, src/webhook/subresources.rs `TABLE`:
these rows (judged like the object), while the webhook's second configuration in webhooks.yaml
routes the rows judged by reading the object they act on (/scale, a pod's binding). The
webhook's and the policy's rules both render from here; tests/chart_subresources.rs checks
both against the table.
*/ -}}
{{- define "fencedlease.judgedSubresources" -}}
{{- $subs := list (printf "%s/status" .resource) }}
{{- if and (eq .group "") (or (eq .resource "pods") (eq .resource "*")) }}
{{- $subs = concat $subs (list "pods/ephemeralcontainers" "pods/resize") }}
{{- end }}
{{- toJson $subs }}
{{- end }}

{{- /* Whether pods are fenced (some fencing.resources entry names them): their bindings are
checked then. */ -}}
{{- define "fencedlease.fencesPods" -}}
{{- range .Values.fencing.resources }}
{{- if and (eq .group "") (or (eq .resource "pods") (eq .resource "*")) }}true{{ end }}
{{- end }}
{{- end }}

{{/* The operations fenced on protected objects: CREATE and UPDATE, and DELETE unless
fencing.deletes is false. */}}
{{- define "fencedlease.fencedOperations" -}}
{{- if .Values.fencing.deletes -}}["CREATE","UPDATE","DELETE"]{{- else -}}["CREATE","UPDATE"]{{- end -}}
{{- end -}}

{{/* Whether the fencing webhook judges writes (fencing.mode webhook or both). */}}
{{- define "fencedlease.fencingWebhook" -}}
{{- if ne .Values.fencing.mode "policy" -}}true{{- end -}}
{{- end -}}

{{/* Whether the fencing policy judges writes (fencing.mode policy or both). */}}
{{- define "fencedlease.fencingPolicy" -}}
{{- if ne .Values.fencing.mode "webhook" -}}true{{- end -}}
{{- end -}}

{{/*
Whether the webhook server runs at all: for the fencing webhook, or for sidecar injection. In
policy mode without injection nothing calls it, and the chart renders none of it (Deployment,
Service, ServiceAccount, RBAC, certificate).
*/}}
{{- define "fencedlease.webhookServer" -}}
{{- if or (include "fencedlease.fencingWebhook" .) .Values.injection.enabled -}}true{{- end -}}
{{- end -}}

{{/* The Service that owns the election lease (and the certificate Secret): the webhook's, or
the controller's when there is no webhook. */}}
{{- define "fencedlease.ownerService" -}}
{{- if include "fencedlease.webhookServer" . -}}
{{- include "fencedlease.serviceName" . -}}
{{- else -}}
{{- include "fencedlease.controllerName" . -}}
{{- end -}}
{{- end -}}

{{- define "fencedlease.mutatingName" -}}
{{- printf "%s-injection" (include "fencedlease.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Comma-separated names of the webhook configurations whose caBundle the operator keeps. */}}
{{- define "fencedlease.webhookConfigurations" -}}
{{- $names := list -}}
{{- if include "fencedlease.fencingWebhook" . -}}
{{- $names = append $names (include "fencedlease.validatingName" .) -}}
{{- end -}}
{{- if .Values.injection.enabled -}}
{{- $names = append $names (include "fencedlease.mutatingName" .) -}}
{{- end -}}
{{- join "," $names -}}
{{- end -}}

{{- define "fencedlease.electionLease" -}}
{{- default (printf "%s-controller" (include "fencedlease.fullname" .) | trunc 63 | trimSuffix "-") .Values.controller.electionLease -}}
{{- end -}}

{{- define "fencedlease.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The injected sidecar's image: injection.sidecar.image, or the operator's image when its
repository is empty. Its pull policy is image.pullPolicy. */}}
{{- define "fencedlease.sidecarImage" -}}
{{- $i := .Values.injection.sidecar.image | default dict -}}
{{- if not $i.repository -}}
{{- include "fencedlease.image" . -}}
{{- else if $i.digest -}}
{{- printf "%s@%s" $i.repository $i.digest -}}
{{- else -}}
{{- printf "%s:%s" $i.repository (default .Chart.AppVersion $i.tag) -}}
{{- end -}}
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
{{- if eq (include "fencedlease.webhookServiceAccountName" .) (include "fencedlease.serviceAccountName" .) -}}
{{- fail (printf "webhook.serviceAccount.name %q is the controller's ServiceAccount: the network-facing webhook must have an identity of its own, without the controller's write rights; choose another name (or leave it empty)" (include "fencedlease.webhookServiceAccountName" .)) -}}
{{- end -}}
{{- $seen := dict -}}
{{- range $i, $w := (.Values.workloads | default list) -}}
{{- $ns := required (printf "workloads[%d].namespace is required: the namespace of the workload's pods" $i) $w.namespace -}}
{{- $sa := required (printf "workloads[%d].serviceAccount is required: the ServiceAccount of the workload's pods" $i) $w.serviceAccount -}}
{{- if not $w.leases -}}
{{- fail (printf "workloads[%d].leases is empty: list the FencedLeases (names, in namespace %s) that %s campaigns for" $i $ns $sa) -}}
{{- end -}}
{{- $key := printf "%s/%s" $ns $sa -}}
{{- if hasKey $seen $key -}}
{{- fail (printf "workloads: %s is listed twice: give each ServiceAccount one entry and list all its leases there" $key) -}}
{{- end -}}
{{- $_ := set $seen $key true -}}
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
- name: FENCEDLEASE_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "fencedlease.containerSecurityContext" -}}
{{- toYaml .Values.containerSecurityContext -}}
{{- end -}}

{{/* Pod template metadata of one component: (dict "root" $ "component" "controller"|"webhook"). */}}
{{- define "fencedlease.podMetadata" -}}
labels:
  {{- include "fencedlease.labels" .root | nindent 2 }}
  app.kubernetes.io/component: {{ .component }}
  {{- with .root.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  # The operator's own pods never get the sidecar.
  fencedlease.io/inject: "false"
{{- with .root.Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Pod spec settings both Deployments share: (dict "root" $ "component" ...). */}}
{{- define "fencedlease.podSpecCommon" -}}
{{- $v := .root.Values -}}
automountServiceAccountToken: true
enableServiceLinks: false
{{- with $v.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $v.podSecurityContext | nindent 2 }}
{{- with $v.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- range . }}
  - {{- toYaml (merge (deepCopy .) (dict "labelSelector" (dict "matchLabels" (fromYaml (include "fencedlease.componentSelectorLabels" $))))) | nindent 4 }}
  {{- end }}
{{- end }}
{{- with $v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
affinity:
  {{- if $v.affinity }}
  {{- toYaml $v.affinity | nindent 2 }}
  {{- else }}
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "fencedlease.componentSelectorLabels" . | nindent 14 }}
  {{- end }}
{{- end -}}

{{/* Probes on a named metrics port. */}}
{{- define "fencedlease.probes" -}}
livenessProbe:
  httpGet:
    path: /livez
    port: {{ . }}
  initialDelaySeconds: 5
  periodSeconds: 10
  timeoutSeconds: 2
  failureThreshold: 3
readinessProbe:
  httpGet:
    path: /readyz
    port: {{ . }}
  periodSeconds: 5
  timeoutSeconds: 2
  failureThreshold: 2
{{- end -}}

{{/*
The labels and annotations the webhooks read, as the keys in elector/src/api.rs name them
(tests/webhook_match_conditions.rs checks that the rendered ones agree).
*/}}
{{- define "fencedlease.leaseKey" -}}fencedlease.io/lease{{- end -}}
{{- define "fencedlease.injectKey" -}}fencedlease.io/inject{{- end -}}
{{- /* Policy mode's lease index on each namespace (elector/src/api.rs LEASE_INDEX_ANNOTATION). */ -}}
{{- define "fencedlease.indexKey" -}}fencedlease.io/leases{{- end -}}

{{- /* Who may write the lease index, as a JSON list: the controller's ServiceAccount and
fencing.indexWriters. */ -}}
{{- define "fencedlease.indexWriters" -}}
{{- prepend .Values.fencing.indexWriters (printf "system:serviceaccount:%s:%s" .Release.Namespace (include "fencedlease.serviceAccountName" .)) | toJson -}}
{{- end -}}
{{- define "fencedlease.stampKeys" -}}
{{- list "fencedlease.io/token" "fencedlease.io/lease-uid" "fencedlease.io/write-id" "fencedlease.io/delete-intent" | toJson -}}
{{- end -}}

{{/*
"true" when the server evaluates matchConditions on webhooks (GA in Kubernetes 1.30). Older
servers get the webhooks without them, which call the webhook for every request they match.
*/}}
{{- define "fencedlease.matchConditions" -}}
{{- if semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version -}}true{{- end -}}
{{- end -}}

{{/*
CEL: the writer is one of fencing.exemptUsers or fencing.exemptGroups (exact names, as the
webhook's --exempt-user and --exempt-group compare them). Empty when both lists are.
*/}}
{{- define "fencedlease.celExemptWriter" -}}
{{- $f := .Values.fencing -}}
{{- $any := list -}}
{{- with $f.exemptUsers -}}
{{- $any = append $any (printf "request.userInfo.username in %s" (toJson .)) -}}
{{- end -}}
{{- with $f.exemptGroups -}}
{{- $any = append $any (printf "(has(request.userInfo.groups) && request.userInfo.groups.exists(g, g in %s))" (toJson .)) -}}
{{- end -}}
{{- if $any -}}({{ join " || " $any }}){{- end -}}
{{- end -}}

{{/* CEL: the value of label or annotation KEY in map MAP of OBJ ("object" or "oldObject"),
as a list of none or one: (list OBJ MAP KEY). */}}
{{- define "fencedlease.celEntry" -}}
{{- $o := index . 0 -}}{{- $m := index . 1 -}}{{- $k := index . 2 -}}
(has({{ $o }}.metadata.{{ $m }}) && '{{ $k }}' in {{ $o }}.metadata.{{ $m }} ? [{{ $o }}.metadata.{{ $m }}['{{ $k }}']] : [])
{{- end -}}

{{/*
CEL: an update that leaves the fencing label and annotations as they were. The webhook reads an
empty lease label as none, and tells an absent annotation from an empty one.
*/}}
{{- define "fencedlease.celFencingUnchanged" -}}
{{- $lease := include "fencedlease.leaseKey" . -}}
{{- $same := list "oldObject != null" -}}
{{- $same = append $same (printf "%s.filter(v, v != '') == %s.filter(v, v != '')" (include "fencedlease.celEntry" (list "object" "labels" $lease)) (include "fencedlease.celEntry" (list "oldObject" "labels" $lease))) -}}
{{- range (include "fencedlease.stampKeys" . | fromJsonArray) -}}
{{- $same = append $same (printf "%s == %s" (include "fencedlease.celEntry" (list "object" "annotations" .)) (include "fencedlease.celEntry" (list "oldObject" "annotations" .))) -}}
{{- end -}}
{{ join " && " $same }}
{{- end -}}

{{/* The namespaces never fenced, as a JSON list: fencing.excludeNamespaces, and the release's
own unless fencing.excludeReleaseNamespace is false. */}}
{{- define "fencedlease.unfencedNamespaces" -}}
{{- $excluded := list -}}
{{- range .Values.fencing.excludeNamespaces -}}
{{- $excluded = append $excluded . -}}
{{- end -}}
{{- if .Values.fencing.excludeReleaseNamespace -}}
{{- $excluded = append $excluded .Release.Namespace -}}
{{- end -}}
{{- $excluded | uniq | toJson -}}
{{- end -}}

{{/*
The namespaceSelector of the fencing webhooks and policy: fencing.namespaceSelector, with the
excluded namespaces (fencedlease.unfencedNamespaces) added as a NotIn on
kubernetes.io/metadata.name.
*/}}
{{- define "fencedlease.fencingNamespaceSelector" -}}
{{- $sel := deepCopy (.Values.fencing.namespaceSelector | default dict) -}}
{{- $excluded := include "fencedlease.unfencedNamespaces" . | fromJsonArray -}}
{{- if $excluded -}}
{{- $exprs := get $sel "matchExpressions" | default list -}}
{{- $not := dict "key" "kubernetes.io/metadata.name" "operator" "NotIn" "values" ($excluded | uniq) -}}
{{- $_ := set $sel "matchExpressions" (append $exprs $not) -}}
{{- end -}}
{{- toYaml $sel -}}
{{- end -}}
