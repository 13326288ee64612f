{{/* Names, labels and the RBAC rules shared by the templates. */}}

{{- define "sluice.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sluice.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "sluice.labels" -}}
{{ include "sluice.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The chart's PrometheusRule and dashboard ConfigMaps. */}}
{{- define "sluice.monitoring.labels" -}}
app.kubernetes.io/name: {{ include "sluice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: monitoring
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "sluice.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "sluice.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "sluice.image" -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "v%s" .Chart.AppVersion) .Values.image.tag) -}}
{{- end -}}

{{/* The engine image endpoints run unless they name their own (the operator's SLUICE_ENGINE_IMAGE). */}}
{{- define "sluice.engineImage" -}}
{{- printf "%s:%s" .Values.engine.image.repository (default (printf "v%s" .Chart.AppVersion) .Values.engine.image.tag) -}}
{{- end -}}

{{/* The gateway: `sluice gateway`, from the operator image unless gateway.image says otherwise. */}}
{{- define "sluice.gateway.fullname" -}}
{{- printf "%s-gateway" (include "sluice.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sluice.gateway.image" -}}
{{- $repository := default .Values.image.repository .Values.gateway.image.repository -}}
{{- $tag := default (default (printf "v%s" .Chart.AppVersion) .Values.image.tag) .Values.gateway.image.tag -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}

{{- define "sluice.gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end -}}

{{- define "sluice.gateway.labels" -}}
{{ include "sluice.gateway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "sluice.gateway.serviceAccountName" -}}
{{- if .Values.gateway.serviceAccount.create -}}
{{- default (include "sluice.gateway.fullname" .) .Values.gateway.serviceAccount.name -}}
{{- else -}}
{{- required "gateway.serviceAccount.name is required when gateway.serviceAccount.create is false" .Values.gateway.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The address KEDA's external-push trigger dials, and the URL clients of autoscaled endpoints use. */}}
{{- define "sluice.gateway.host" -}}
{{- printf "%s.%s.svc" (include "sluice.gateway.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/* The namespaces served when scope is "namespace", as a JSON list (`include ... | fromJsonArray`):
watchNamespaces, else watchNamespace, else the release namespace. */}}
{{- define "sluice.watchNamespaces" -}}
{{- if .Values.watchNamespaces -}}
{{- toJson (uniq .Values.watchNamespaces) -}}
{{- else -}}
{{- toJson (list (default .Release.Namespace .Values.watchNamespace)) -}}
{{- end -}}
{{- end -}}

{{/*
What the operator does inside the namespaces it serves (least privilege: only what it manages).
Each verb is one the code uses (tests/test_chart.py checks them against the operator's client and handlers):
- InferenceEndpoints: listed and watched by kopf (and read and listed by the resync); kopf patches its
  progress annotations; status is merge-patched through the status subresource. The operator never writes spec.
- ServedModels (model versions by weight): watched by kopf (which patches its progress annotations); the
  operator writes only their status (each version's readiness and traffic share), through the subresource.
- inferenceendpoints/finalizers update: children's ownerReferences set blockOwnerDeletion, which the
  OwnerReferencesPermissionEnforcement admission plugin allows only to whoever can update this.
- Children: applied server-side (patch; create for an object that does not exist yet), read for their status
  (get), listed and deleted by the prune pass. Only the workloads are watched (their events move the status);
  nothing is ever replaced with a PUT (no update).
- Events: created (kopf's about handler progress; the operator's on phase transitions).
- Pods: listed only, the serving pods' scheduling and model load become status conditions.
- Secrets: created only (a disaggregated endpoint's KV key, disaggregation.py); never read, listed or watched.
- NetworkPolicies: like the other children (network_policy.py).
*/}}
{{- define "sluice.namespacedRules" -}}
- apiGroups: [sluice.dev]
  resources: [inferenceendpoints]
  verbs: [get, list, watch, patch]
- apiGroups: [sluice.dev]
  resources: [inferenceendpoints/status]
  verbs: [patch]
- apiGroups: [sluice.dev]
  resources: [inferenceendpoints/finalizers]
  verbs: [update]
- apiGroups: [sluice.dev]
  resources: [servedmodels]
  verbs: [get, list, watch, patch]
- apiGroups: [sluice.dev]
  resources: [servedmodels/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, create, patch, delete]
# watch: the endpoint picker's Role (spec.routing.inferencePool) grants it, and a Role may only grant what its
# creator holds (RBAC escalation prevention).
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, create, patch, delete]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [keda.sh]
  resources: [scaledobjects, triggerauthentications]
  verbs: [get, list, create, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors, prometheusrules]
  verbs: [get, list, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, create, patch, delete]
# spec.routing.inferencePool (Gateway API Inference Extension): the InferencePool, the HTTPRoute, and the endpoint
# picker's ServiceAccount, Role and RoleBinding. The picker's Role reads InferenceEndpoints, Services,
# EndpointSlices and InferenceObjectives (get, list, watch) in the endpoint's namespace: the operator holds
# exactly that (above and below), so the API server lets it create the Role without escalate or bind.
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, create, patch, delete]
# Read only, and only because the picker's Role grants it: the picker takes the priorities of the
# InferenceObjectives that name its pool.
- apiGroups: [inference.networking.x-k8s.io]
  resources: [inferenceobjectives]
  verbs: [get, list, watch]
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [get, list, create, patch, delete]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, list, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, create, patch, delete]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
# The KV key of a disaggregated endpoint: created once, never read back (no get, list or watch: the operator
# cannot read any Secret); the garbage collector deletes it with its endpoint.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
# Shared model caches (spec.model.cache.type shared): a claim and a fetch Job per model, and the fetch pod's log
# for the download's progress.
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
{{- with .Values.rbac.extraRules }}
{{ toYaml . }}
{{- end }}
{{- end -}}


{{/*
What the gateway reads, in the namespaces it serves: InferenceEndpoints (which model each serves) and the
EndpointSlices of their Services (the backends, by role), and the Services themselves. Read only.
*/}}
{{- define "sluice.gateway.rules" -}}
- apiGroups: [sluice.dev]
  resources: [inferenceendpoints, servedmodels]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch]
{{- end -}}

{{/*
Who the operator's per-endpoint NetworkPolicies admit to the engines' API port (operator/sluice_operator/
network_policy.py), as JSON lists of NetworkPolicyPeers: the gateway's pods and the operator's, in the release
namespace.
*/}}
{{- define "sluice.networkPolicy.gatewayPeers" -}}
{{- if .Values.gateway.enabled -}}
{{- toJson (list (dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace)) "podSelector" (dict "matchLabels" (include "sluice.gateway.selectorLabels" . | fromYaml)))) -}}
{{- else -}}
[]
{{- end -}}
{{- end -}}

{{- define "sluice.networkPolicy.operatorPeers" -}}
{{- toJson (list (dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace)) "podSelector" (dict "matchLabels" (include "sluice.selectorLabels" . | fromYaml)))) -}}
{{- end -}}

{{/*
The engines' extra ingress rules: networkPolicy.engines.extraIngress, and, without a gateway, the API port from
networkPolicy.gateway.clients (empty: from anyone), since clients then call the endpoints' Services directly.
*/}}
{{- define "sluice.networkPolicy.extraIngress" -}}
{{- $rules := .Values.networkPolicy.engines.extraIngress | default list -}}
{{- if not .Values.gateway.enabled -}}
{{- $direct := dict "ports" (list (dict "port" "http" "protocol" "TCP")) -}}
{{- with .Values.networkPolicy.gateway.clients -}}
{{- $_ := set $direct "from" . -}}
{{- end -}}
{{- $rules = append $rules $direct -}}
{{- end -}}
{{- toJson $rules -}}
{{- end -}}

{{/* The Secret of KEDA's client certificate for the gateway's scaler; empty: none (plaintext gRPC). */}}
{{- /* The Secret holding the gateway replicas' shared peer token (gateway.peerToken); empty: none. */ -}}
{{- define "sluice.gateway.peerTokenSecret" -}}
{{- if .Values.gateway.peerToken.existingSecret -}}
{{- .Values.gateway.peerToken.existingSecret -}}
{{- else if .Values.gateway.peerToken.generate -}}
{{- printf "%s-peer-token" (include "sluice.gateway.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "sluice.gateway.scalerTLSSecret" -}}
{{- if .Values.gateway.scalerTLS.existingSecret -}}
{{- .Values.gateway.scalerTLS.existingSecret -}}
{{- else if .Values.gateway.scalerTLS.generate -}}
{{- printf "%s-scaler-tls" (include "sluice.gateway.fullname" .) -}}
{{- end -}}
{{- end -}}
