{{/*
Names. Every object name comes from one of these helpers, so that the
cross-references (ServiceAccount, selector, Lease, the hook's flags) cannot
drift apart; chart-tests/names_test.yaml checks that they agree.
*/}}

{{/* The chart name, for the app.kubernetes.io/name label. */}}
{{- define "flux-plunger.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name of the controller's objects: the release name when it already
contains the chart name, else "<release>-<chart>". 63 characters at most (a
label value and a DNS label).
*/}}
{{- define "flux-plunger.fullname" -}}
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

{{/* The pre-delete hook's objects: "<fullname>-pre-delete", 63 characters at most. */}}
{{- define "flux-plunger.hookName" -}}
{{- printf "%s-pre-delete" (include "flux-plunger.fullname" . | trunc 52 | trimSuffix "-") }}
{{- end }}

{{/* The controller's ServiceAccount. */}}
{{- define "flux-plunger.serviceAccountName" -}}
{{- include "flux-plunger.fullname" . }}
{{- end }}

{{/* The leader Lease, in the release namespace. */}}
{{- define "flux-plunger.leaseName" -}}
{{- default (include "flux-plunger.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{/* helm.sh/chart label value. */}}
{{- define "flux-plunger.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The labels that select the controller pods: the Deployment's selector, the
metrics Service's selector and the hook's --pod-selector are all this set.
A Deployment's selector is immutable, so this set must never change.
The hook's own pod carries component=pre-delete-hook and so is never selected.
*/}}
{{- define "flux-plunger.selectorLabels" -}}
app.kubernetes.io/name: {{ include "flux-plunger.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controller
{{- end }}

{{/* The controller pods' selector as the hook takes it: k=v,k=v in key order. */}}
{{- define "flux-plunger.podSelector" -}}
{{- $pairs := list }}
{{- range $key, $value := include "flux-plunger.selectorLabels" . | fromYaml }}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/*
The scope flags, one per line: the controller watches these releases, and the
drain and the pre-delete hook release fences only there, so that two installs
with separate scopes never let go of each other's releases.
*/}}
{{- define "flux-plunger.scopeArgs" -}}
{{- range .Values.controller.watchNamespaces }}
- --watch-namespace={{ . }}
{{- end }}
{{- with .Values.controller.watchLabelSelector }}
- --watch-label-selector={{ . }}
{{- end }}
{{- end }}

{{/*
Whether the install is scoped to namespaces (controller.watchNamespaces set).
Scoped, the chart grants the controller, the drain and the pre-delete hook
their HelmRelease, Event and Secret permissions by a Role and RoleBinding in
each namespace they act in, never cluster-wide, and the admission guard
refuses their writes elsewhere. Renders "true" or nothing.
*/}}
{{- define "flux-plunger.scoped" -}}
{{- if .Values.controller.watchNamespaces -}}
true
{{- end }}
{{- end }}

{{/* The watched namespaces, each once, in the order given. A YAML list. */}}
{{- define "flux-plunger.watchNamespaces" -}}
{{- toYaml (uniq .Values.controller.watchNamespaces) }}
{{- end }}

{{/*
The namespaces a scoped install reads and deletes Helm storage in: the
watched ones (a release's storage is in its own namespace unless its
spec.storageNamespace says otherwise; a remote kubeConfig's Secret is in
the release's namespace too), then controller.storageNamespaces, each once.
A YAML list.
*/}}
{{- define "flux-plunger.storageNamespaces" -}}
{{- toYaml (concat .Values.controller.watchNamespaces .Values.controller.storageNamespaces | uniq) }}
{{- end }}

{{/* The per-namespace Role and RoleBinding of a scoped install: "<fullname>-scope". */}}
{{- define "flux-plunger.scopeRoleName" -}}
{{- printf "%s-scope" (include "flux-plunger.fullname" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{/* The hook's per-namespace Role and RoleBinding of a scoped install: "<hook name>-scope". */}}
{{- define "flux-plunger.hookScopeRoleName" -}}
{{- printf "%s-scope" (include "flux-plunger.hookName" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{/*
The controller's rules on HelmReleases and Events, cluster-wide (ClusterRole)
or in one watched namespace (Role).
*/}}
{{- define "flux-plunger.releaseRules" -}}
# Watch the releases; every write is a server-side apply or a JSON/merge
# patch, so `patch` is the only write verb.
- apiGroups:
    - helm.toolkit.fluxcd.io
  resources:
    - helmreleases
  verbs:
    - get
    - list
    - watch
    - patch
# A release deleted after helm-controller cleared its history is handed to
# helm-controller's uninstall by writing its newest revision to
# status.history (a merge patch locked on the resourceVersion read).
- apiGroups:
    - helm.toolkit.fluxcd.io
  resources:
    - helmreleases/status
  verbs:
    - patch
{{- end }}

{{/*
The controller's rules on Secrets, cluster-wide or in one namespace. Helm's
storage Secrets are read straight from the apiserver when a decision depends
on them and are never watched: a watch would cache every Secret in reach in
the controller. Before it touches storage outside a release's own namespace,
the controller asks by a LocalSubjectAccessReview there whether the
ServiceAccount helm-controller acts as for that release could
(plunger::storage::reach).
*/}}
{{- define "flux-plunger.secretRules" -}}
- apiGroups:
    - ""
  resources:
    - secrets
  verbs:
    - get
    - list
    - delete
- apiGroups:
    - authorization.k8s.io
  resources:
    - localsubjectaccessreviews
  verbs:
    - create
{{- end }}

{{/*
The flag of the ServiceAccount helm-controller acts as for a release that
names none, for the controller and the drain (both read storage).
*/}}
{{- define "flux-plunger.tenancyArgs" -}}
{{- with .Values.controller.defaultServiceAccount }}
- --default-service-account={{ . }}
{{- end }}
{{- end }}

{{/*
The controller's rule on Events. kube's event recorder writes
events.k8s.io/v1 Events only, in the HelmRelease's namespace (a repeat
becomes a series: `patch`); the core group's Events are never written.
*/}}
{{- define "flux-plunger.eventRules" -}}
- apiGroups:
    - events.k8s.io
  resources:
    - events
  verbs:
    - create
    - patch
{{- end }}

{{/*
Labels of every object: the chart's, then commonLabels, which cannot replace
one of the chart's (the name, instance and component are what the selectors
match, managed-by is what Helm adopts objects by). Call with
(dict "context" $ "component" "...") and, for the controller's Deployment,
"fluxComponent" true: with the value fluxComponent it is part of flux, as
Flux's own controllers are (what `flux logs` lists Deployments by).
*/}}
{{- define "flux-plunger.labels" -}}
{{- $own := dict
  "helm.sh/chart" (include "flux-plunger.chart" .context)
  "app.kubernetes.io/name" (include "flux-plunger.name" .context)
  "app.kubernetes.io/instance" .context.Release.Name
  "app.kubernetes.io/component" .component
  "app.kubernetes.io/version" .context.Chart.AppVersion
  "app.kubernetes.io/managed-by" .context.Release.Service
  "app.kubernetes.io/part-of" (include "flux-plunger.partOf" (dict "context" .context "fluxComponent" .fluxComponent)) }}
{{- merge $own (.context.Values.commonLabels | default dict) | toYaml }}
{{- end }}

{{/*
The part-of label of the controller's Deployment and pods (`.fluxComponent`
true) and of every other object: `flux` for the first with the value
fluxComponent, `flux-plunger` otherwise.
*/}}
{{- define "flux-plunger.partOf" -}}
{{- if and .fluxComponent .context.Values.fluxComponent }}flux{{ else }}flux-plunger{{ end }}
{{- end }}

{{/*
Labels of a pod template: `.own` (a map: the selector labels, or the hook
pod's), then podLabels for the controller's pods (`.podLabels`), then
commonLabels. Only `.own` is ever selected on: a Deployment's selector is
immutable, so commonLabels and podLabels stay out of it. Call with
(dict "context" $ "own" (...) "podLabels" (...)).
*/}}
{{- define "flux-plunger.podLabels" -}}
{{- $own := deepCopy .own }}
{{- if and .fluxComponent .context.Values.fluxComponent }}
{{- $_ := set $own "app.kubernetes.io/part-of" "flux" }}
{{- end }}
{{- merge $own (.podLabels | default dict) (.context.Values.commonLabels | default dict) | toYaml }}
{{- end }}

{{/*
topologySpreadConstraints, each without a labelSelector given the controller
pods' selector labels: a constraint selecting no pods spreads nothing. A
YAML list, or nothing.
*/}}
{{- define "flux-plunger.topologySpreadConstraints" -}}
{{- $constraints := list }}
{{- range .Values.topologySpreadConstraints }}
{{- $constraint := deepCopy . }}
{{- if not (hasKey $constraint "labelSelector") }}
{{- $_ := set $constraint "labelSelector" (dict "matchLabels" (include "flux-plunger.selectorLabels" $ | fromYaml)) }}
{{- end }}
{{- $constraints = append $constraints $constraint }}
{{- end }}
{{- with $constraints }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/*
The ports of a NetworkPolicy egress rule, each TCP: `.ports` (a list of
numbers), taken from the value `.value`. An empty list is refused here as well
as by values.schema.json (so that --skip-schema-validation cannot get it
through): a rule without ports allows every port. A YAML list.
*/}}
{{- define "flux-plunger.tcpPorts" -}}
{{- if not .ports }}
{{- fail (printf "%s is empty: an egress rule without ports would allow every port" .value) }}
{{- end }}
{{- range $i, $port := .ports }}
{{- if $i }}
{{ end -}}
- port: {{ $port }}
  protocol: TCP
{{- end }}
{{- end }}

{{/* The image of every container: repository@digest when a digest is given, else repository:tag. */}}
{{- define "flux-plunger.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
shutdownGracePeriodSeconds, validated here as well as by values.schema.json so
that `--skip-schema-validation` still refuses a value the binaries would refuse.
The messages are those of plunger::timings::GracePeriodError; the contract tests
compare them. Renders the whole number of seconds.
*/}}
{{- define "flux-plunger.gracePeriodSeconds" -}}
{{- $g := .Values.shutdownGracePeriodSeconds }}
{{- $whole := false }}
{{- if or (kindIs "int" $g) (kindIs "int64" $g) (kindIs "float64" $g) }}
{{- $whole = eq (float64 $g) (floor $g) }}
{{- end }}
{{- if not $whole }}
{{- fail (printf "shutdownGracePeriodSeconds must be a whole number of seconds between 40 and 140, got %q" (toString $g)) }}
{{- end }}
{{- if or (lt (float64 $g) 40.0) (gt (float64 $g) 140.0) }}
{{- fail (printf "shutdownGracePeriodSeconds must be between 40 and 140 seconds, got %.0f: below 40 the drain deadline (grace period - 25 s) is too short to carry a delete through its uninstall; above 140 the hook's pod wait (grace period + 10 s) no longer fits its 180-second retry window" (float64 $g)) }}
{{- end }}
{{- printf "%.0f" (float64 $g) }}
{{- end }}

{{/*
The pre-delete hook's budget (SPEC §7), the same constants as
plunger::timings: under helm-controller's 300 s uninstall timeout, so that the
Job and not helm-controller decides how the hook ends.
*/}}
{{- define "flux-plunger.hookActiveDeadlineSeconds" -}}
240
{{- end }}

{{/* How long the finished hook Job stays, so that its report can be read. */}}
{{- define "flux-plunger.hookTtlSecondsAfterFinished" -}}
600
{{- end }}

{{/*
Restricted Pod Security Standard, pod level: runAsNonRoot and the runtime's
seccomp profile always; the ids podSecurityContext gives (65532, the image's
user, by default), each left out where it is set to null, for a platform
that assigns its own (OpenShift's restricted SCC picks a UID of the
namespace's range and refuses a pod naming another). Left out, the image's
numeric USER 65532 applies, which runAsNonRoot can verify.
*/}}
{{- define "flux-plunger.podSecurityContext" -}}
{{- $ids := .Values.podSecurityContext | default dict -}}
runAsNonRoot: true
{{- range $key := list "runAsUser" "runAsGroup" "fsGroup" }}
{{- if and (hasKey $ids $key) (not (kindIs "invalid" (index $ids $key))) }}
{{ $key }}: {{ index $ids $key | int64 }}
{{- end }}
{{- end }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
Restricted Pod Security Standard, every container; not a value, so that no
install runs flux-plunger with less. The containers name no ids: the pod's
apply.
*/}}
{{- define "flux-plunger.containerSecurityContext" -}}
runAsNonRoot: true
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
POD_NAME and POD_NAMESPACE from the downward API: the Lease holder identity
and the Lease namespace of the controller and the drain; then extraEnv.
*/}}
{{- define "flux-plunger.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- with include "flux-plunger.extraEnv" . }}
{{ . }}
{{- end }}
{{- end }}

{{/*
extraEnv, a YAML list (nothing when empty), for after the chart's variables. The chart's own variables cannot be replaced:
of two entries with one name the container gets the later, and a second
POD_NAME would give every replica one Lease identity (two writers), a second
POD_NAMESPACE another Lease than the one the admission guard allows.
*/}}
{{- define "flux-plunger.extraEnv" -}}
{{- range .Values.extraEnv }}
{{- if has .name (list "POD_NAME" "POD_NAMESPACE") }}
{{- fail (printf "extraEnv: %s is set by the chart from the downward API (the Lease's holder identity and namespace) and cannot be replaced" .name) }}
{{- end }}
{{- end }}
{{- with .Values.extraEnv }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/*
The controller's flags the chart passes, or that a value of the chart
stands for, each with what to do instead. extraArgs may name none of them: the
controller refuses a flag given twice at start (a crash loop), and a second
--watch-namespace or --watch-label-selector, which it would accept, would
widen the controller's scope beyond its RBAC, its drain's and its hook's.
A YAML map, flag name to advice.
*/}}
{{- define "flux-plunger.chartFlags" -}}
log-level: set logLevel
log-encoding: set logEncoding
concurrent: set controller.concurrent
metrics-addr: "the metrics port is 8080, where the pod's port, the Service and the NetworkPolicy point"
health-addr: "the health port is 9440, where the probes point"
leader-elect: "leader election is always on"
enable-leader-election: "leader election is always on"
leader-election-lease-name: set leaderElection.leaseName
leader-election-namespace: "the Lease is in the release namespace (POD_NAMESPACE)"
pod-name: "each pod is its own Lease holder (POD_NAME)"
shutdown-grace-period-seconds: set shutdownGracePeriodSeconds
max-recoveries-per-minute: set controller.maxRecoveriesPerMinute
dry-run: set controller.dryRun
watch-namespace: set controller.watchNamespaces
watch-label-selector: set controller.watchLabelSelector
default-service-account: set controller.defaultServiceAccount
events-addr: set eventsAddr
{{- end }}

{{/*
extraArgs, a YAML list (nothing when empty), refused when one names a flag of
flux-plunger.chartFlags, or asks for the help or the version (--help, -h,
--version, -V): the controller prints it and exits 0 without running, and the
kubelet restarts a Deployment's container whatever its exit code, so the pod
would loop for ever with nothing in its log but the help. Any other flag is
passed as given, after the chart's: one the image does not know stops the
controller at start with clap's "unexpected argument" (exit code 2).
*/}}
{{- define "flux-plunger.extraArgs" -}}
{{- $owned := include "flux-plunger.chartFlags" . | fromYaml }}
{{- range .Values.extraArgs }}
{{- $arg := toString . }}
{{- $flag := regexReplaceAll "^--([^=]*).*$" $arg "${1}" }}
{{- if hasKey $owned $flag }}
{{- fail (printf "extraArgs: --%s is the chart's to pass (the controller refuses a flag given twice): %s" $flag (get $owned $flag)) }}
{{- end }}
{{- if or (has $flag (list "help" "version")) (has $arg (list "-h" "-V")) }}
{{- $ask := ternary (printf "--%s" $flag) $arg (has $flag (list "help" "version")) }}
{{- fail (printf "extraArgs: %s makes the controller print and exit without running, and the pod would restart it for ever: ask a running pod instead, kubectl exec -n %s deploy/%s -c flux-plunger -- flux-plunger %s" $arg $.Release.Namespace (include "flux-plunger.fullname" $) $ask) }}
{{- end }}
{{- end }}
{{- with .Values.extraArgs }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/*
The admission guard (admission-policy.yaml, admission-policy-binding.yaml) is
rendered with admissionGuard.enabled, and needs a cluster that serves
admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy (Kubernetes 1.30
and later), as its discovery tells helm install and helm-controller. Where
the cluster does not, the render fails rather than install flux-plunger
without its guard: only admissionGuard.enabled=false, set explicitly,
installs it bounded by RBAC alone. Offline, `helm template` knows API groups
but no kinds: it renders the guard when told
`--api-versions admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy`.
Renders "true" or nothing.
*/}}
{{- define "flux-plunger.admissionGuard.enabled" -}}
{{- if .Values.admissionGuard.enabled -}}
{{- if not (.Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy") -}}
{{- fail "admissionGuard.enabled is true, but the cluster does not serve admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy (Kubernetes 1.30 and later), so the admission guard cannot be installed and flux-plunger's ServiceAccounts would be held by RBAC alone (every Secret and every HelmRelease of the cluster). Install on a cluster that serves it; with helm template, pass --api-versions admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy when the target cluster serves it; to install without the guard, set admissionGuard.enabled=false" -}}
{{- end -}}
true
{{- end }}
{{- end }}

{{/*
The users the admission guard holds: the controller's ServiceAccount (the
controller and the drain sidecar) and the pre-delete hook's. A YAML list.
*/}}
{{- define "flux-plunger.guardedUsers" -}}
- system:serviceaccount:{{ .Release.Namespace }}:{{ include "flux-plunger.serviceAccountName" . }}
{{- if .Values.preDeleteHook.enabled }}
- system:serviceaccount:{{ .Release.Namespace }}:{{ include "flux-plunger.hookName" . }}
{{- end }}
{{- end }}

{{/*
What flux-plunger writes in a HelmRelease's metadata: its fence finalizer,
its annotations (the processed revision and the uid below it; helm-
controller's reconcile request) and its own labels. The admission guard lets
no other metadata change. The names are plunger::names' FENCE_FINALIZER,
OWN_ANNOTATIONS and OWN_LABELS; the contract tests compare them.
*/}}
{{- define "flux-plunger.ownFinalizer" -}}
flux-plunger.cozystack.io/uninstall-fence
{{- end }}

{{- define "flux-plunger.ownAnnotations" -}}
- flux-plunger.cozystack.io/last-processed-version
- flux-plunger.cozystack.io/last-processed-below-uid
- reconcile.fluxcd.io/requestedAt
{{- end }}

{{- define "flux-plunger.ownLabels" -}}
- flux-plunger.cozystack.io/uninstall-fence
{{- end }}

{{/*
The Helm release statuses whose newest revision explains "has no deployed
releases": the only storage revisions flux-plunger deletes, and so the only
ones the admission guard lets it delete (never a deployed or superseded one).
The statuses plunger::decide::status_explains_stuck accepts; the contract
tests compare them.
*/}}
{{- define "flux-plunger.reclaimableStatuses" -}}
- uninstalling
- uninstalled
- unknown
{{- end }}

{{/*
A CEL condition for the admission guard: the map `.new` differs from the map
`.old` at most at the keys of the CEL list `.keys` (added, removed or
changed there); every other key is in both, with equal values. Call with
(dict "new" "..." "old" "..." "keys" "[...]").
*/}}
{{- define "flux-plunger.guard.changesAtMost" -}}
({{ .new }}.all(k, k in {{ .keys }} || (k in {{ .old }} && {{ .old }}[k] == {{ .new }}[k])) && {{ .old }}.all(k, k in {{ .keys }} || k in {{ .new }}))
{{- end }}

{{/*
A CEL value for the admission guard: the field `.field` of the request's
object, or `.empty` ({} or []) where the object leaves it out or holds null
(the last finalizer removed leaves `finalizers: null`).
*/}}
{{- define "flux-plunger.guard.orEmpty" -}}
has({{ .field }}) && {{ .field }} != null ? {{ .field }} : {{ .empty }}
{{- end }}

{{/*
The field managers flux-plunger writes HelmReleases under: its server-side
apply and its status and reconcile-request patches (flux-plunger), the
guarded JSON patch of the controller and the drain (flux-plunger-patch) and
of the sweeper (flux-plunger-sweep), the annotation patch
(flux-client-side-apply). plunger::names' FIELD_MANAGER,
PATCH_FIELD_MANAGER, SWEEP_FIELD_MANAGER and SHARED_FIELD_MANAGER; the
contract tests compare them. A YAML list.
*/}}
{{- define "flux-plunger.ownFieldManagers" -}}
- flux-plunger
- flux-plunger-patch
- flux-plunger-sweep
- flux-client-side-apply
{{- end }}

{{/*
What helm-controller's Ready condition says, in some words of it, of a
release Helm storage may have left stuck (SPEC §1, §4.6),
plunger::names::STUCK_MESSAGES; the contract tests compare them. A YAML list.
*/}}
{{- define "flux-plunger.stuckMessages" -}}
- has no deployed releases
- cannot re-use a name that is still in use
- cannot reuse a name that is still in use
- "unable to determine state for release with status 'uninstalling'"
- "unable to determine state for release with status 'unknown'"
{{- end }}

{{/*
A CEL value for the admission guard: the map at key `.key` of the CEL map
`.map`, or {} where it has none. fieldsV1 is a tree of such maps ("f:spec",
"f:suspend", …), and a manager that owns nothing below a key has no key.
*/}}
{{- define "flux-plunger.guard.at" -}}
{{ .map }}[?{{ .key | quote }}].orValue({})
{{- end }}

{{/*
The fieldsV1 subtrees of a managedFields entry's fields `.fields` (a CEL
map) that hold flux-plunger's fields: "spec", "metadata", "finalizers",
"labels", "annotations" (`.of`).
*/}}
{{- define "flux-plunger.guard.fieldsAt" -}}
{{- $meta := include "flux-plunger.guard.at" (dict "map" .fields "key" "f:metadata") }}
{{- if eq .of "spec" }}{{ include "flux-plunger.guard.at" (dict "map" .fields "key" "f:spec") }}
{{- else if eq .of "metadata" }}{{ $meta }}
{{- else }}{{ include "flux-plunger.guard.at" (dict "map" $meta "key" (printf "f:%s" .of)) }}
{{- end }}
{{- end }}

{{/*
A CEL condition: the fields `.new` of a managedFields entry after the write
and `.old` before it (CEL maps, {} for an entry that is not there) agree on
everything but flux-plunger's own fields (spec.suspend, the fence finalizer,
the fence's label, flux-plunger's annotations, and the existence of the
finalizers, labels and annotations themselves, "."). flux-plunger's writes
change nothing else, so the apiserver moves no other field between managers
on them: any other change is the client's.
*/}}
{{- define "flux-plunger.guard.fieldsAgreeButOurs" -}}
{{- $at := dict }}
{{- range $of := list "spec" "metadata" "finalizers" "labels" "annotations" }}
{{- $_ := set $at (printf "new_%s" $of) (include "flux-plunger.guard.fieldsAt" (dict "fields" $.new "of" $of)) }}
{{- $_ := set $at (printf "old_%s" $of) (include "flux-plunger.guard.fieldsAt" (dict "fields" $.old "of" $of)) }}
{{- end -}}
{{ include "flux-plunger.guard.changesAtMost" (dict "new" .new "old" .old "keys" "[\"f:metadata\", \"f:spec\"]") }}
&& {{ include "flux-plunger.guard.changesAtMost" (dict "new" $at.new_spec "old" $at.old_spec "keys" "[\"f:suspend\"]") }}
&& {{ include "flux-plunger.guard.changesAtMost" (dict "new" $at.new_metadata "old" $at.old_metadata "keys" "[\"f:finalizers\", \"f:labels\", \"f:annotations\"]") }}
&& {{ include "flux-plunger.guard.changesAtMost" (dict "new" $at.new_finalizers "old" $at.old_finalizers "keys" "variables.fenceFieldKeys") }}
&& {{ include "flux-plunger.guard.changesAtMost" (dict "new" $at.new_labels "old" $at.old_labels "keys" "variables.labelFieldKeys") }}
&& {{ include "flux-plunger.guard.changesAtMost" (dict "new" $at.new_annotations "old" $at.old_annotations "keys" "variables.annotationFieldKeys") }}
{{- end }}

{{/*
A CEL condition: ownership of one of flux-plunger's fields moved between the
entry before (`.old`, a CEL bool: it owned the field) and after (`.new`) as
the apiserver moves it, the entry being the writer's (`.writer`):
- the apiserver takes a field away from every other manager only when the
  write changed or removed its value (an update always takes what it
  changed; a forced apply takes what it set to another value; what a write
  removes, nobody owns any more), so another manager's entry loses it only
  where `.changed`; the writer's own apply gives up what it leaves out;
- a field is added to the writer's entry only, and only where the write
  changed it (an update owns what it changed; an apply owns what it sets,
  which for flux-plunger is a change, or, for the fence and its label,
  `.claim`: its apply of the fence on a stuck release over a fence already
  listed).
*/}}
{{- define "flux-plunger.guard.ownershipMoved" -}}
({{ .new }} == {{ .old }} || ({{ .old }} && ({{ .writer }} || {{ .changed }})) || ({{ .new }} && {{ .writer }} && ({{ .changed }} || {{ .claim }})))
{{- end }}

{{/*
A CEL condition: every one of flux-plunger's fields changed hands between
the entry's fields `.old` and `.new` as the write lets it (see
flux-plunger.guard.ownershipMoved), the entry being the writer's
(`.writer`). The existence of the finalizers, labels and annotations (".")
goes to the writer whenever it writes into them, and leaves another
manager's entry whenever the write changes one of their keys.
*/}}
{{- define "flux-plunger.guard.ownFieldsMoved" -}}
{{- $n := dict }}
{{- $o := dict }}
{{- range $of := list "spec" "finalizers" "labels" "annotations" }}
{{- $_ := set $n $of (include "flux-plunger.guard.fieldsAt" (dict "fields" $.new "of" $of)) }}
{{- $_ := set $o $of (include "flux-plunger.guard.fieldsAt" (dict "fields" $.old "of" $of)) }}
{{- end -}}
{{ include "flux-plunger.guard.ownershipMoved" (dict "new" (printf "(\"f:suspend\" in %s)" $n.spec) "old" (printf "(\"f:suspend\" in %s)" $o.spec) "writer" .writer "changed" "variables.suspendChanged" "claim" "false") }}
&& {{ include "flux-plunger.guard.ownershipMoved" (dict "new" (printf "(variables.fenceFieldKeys[1] in %s)" $n.finalizers) "old" (printf "(variables.fenceFieldKeys[1] in %s)" $o.finalizers) "writer" .writer "changed" "variables.fenceChanged" "claim" "variables.oldLiveStuck") }}
&& variables.ownLabels.all(k, {{ include "flux-plunger.guard.ownershipMoved" (dict "new" (printf "((\"f:\" + k) in %s)" $n.labels) "old" (printf "((\"f:\" + k) in %s)" $o.labels) "writer" .writer "changed" "(variables.changedLabels.exists(c, c == k))" "claim" "variables.oldLiveStuck") }})
&& variables.ownAnnotations.all(k, {{ include "flux-plunger.guard.ownershipMoved" (dict "new" (printf "((\"f:\" + k) in %s)" $n.annotations) "old" (printf "((\"f:\" + k) in %s)" $o.annotations) "writer" .writer "changed" "(variables.changedAnnotations.exists(c, c == k))" "claim" "false") }})
{{- range $of := list "finalizers" "labels" "annotations" }}
&& {{ include "flux-plunger.guard.ownershipMoved" (dict "new" (printf "(\".\" in %s)" (get $n $of)) "old" (printf "(\".\" in %s)" (get $o $of)) "writer" $.writer "changed" (printf "variables.%sTouched" $of) "claim" "true") }}
{{- end }}
{{- end }}

{{/*
A CEL condition: the managedFields entries `.a` and `.b` are the same
manager's entry as the apiserver keys them: by manager, operation and
subresource, and for an update also by apiVersion (an applier's entry is
one whatever version it applied).
*/}}
{{- define "flux-plunger.guard.sameManager" -}}
{{- $a := .a }}{{ $b := .b -}}
({{ range $i, $f := list "manager" "operation" "subresource" }}{{ if $i }} && {{ end }}(has({{ $a }}.{{ $f }}) ? {{ $a }}.{{ $f }} : "") == (has({{ $b }}.{{ $f }}) ? {{ $b }}.{{ $f }} : ""){{ end }}
 && ((has({{ $b }}.operation) && {{ $b }}.operation == "Apply") || (has({{ $a }}.apiVersion) ? {{ $a }}.apiVersion : "") == (has({{ $b }}.apiVersion) ? {{ $b }}.apiVersion : "")))
{{- end }}

{{/*
A CEL condition: the managedFields entry `.a` is `.b` in everything but its
fields: the apiserver stamps a new time (and the version written) on the
writer's entry only.
*/}}
{{- define "flux-plunger.guard.sameStamp" -}}
{{- $a := .a }}{{ $b := .b -}}
({{ range $i, $f := list "apiVersion" "time" "fieldsType" }}{{ if $i }} && {{ end }}(has({{ $a }}.{{ $f }}) ? {{ $a }}.{{ $f }} : "") == (has({{ $b }}.{{ $f }}) ? {{ $b }}.{{ $f }} : ""){{ end }})
{{- end }}

{{/* A CEL value: the fields (fieldsV1) of the managedFields entry `.entry`, or {}. */}}
{{- define "flux-plunger.guard.fieldsOf" -}}
{{ .entry }}.?fieldsV1.orValue({})
{{- end }}

{{/* A CEL condition: the managedFields entry `.entry` is the writer's (the request's field manager). */}}
{{- define "flux-plunger.guard.isWriter" -}}
(has({{ .entry }}.manager) && {{ .entry }}.manager == variables.writer)
{{- end }}

{{/*
The install a fence's label names (SPEC §1, §3; plunger::install::Install,
the contract tests compare them): "<Lease namespace>.<Lease name>", or past
63 characters its first 50 without a trailing "." or "-", a dash and 12 hex
characters of its SHA-256. Takes (dict "namespace" … "lease" …).
*/}}
{{- define "flux-plunger.installOf" -}}
{{- $full := printf "%s.%s" .namespace .lease }}
{{- if le (len $full) 63 }}
{{- $full }}
{{- else }}
{{- printf "%s-%s" (regexReplaceAll "[.-]+$" (trunc 50 $full) "") (trunc 12 (sha256sum $full)) }}
{{- end }}
{{- end }}

{{/*
Refuses an upgrade that drops a namespace from controller.watchNamespaces (or
scopes an install that watched every namespace) while a HelmRelease there
carries this install's fence (or one labelled `held`, as every install
labelled its fences before the label named one): the install's access to that namespace (its
Roles, the admission guard's scope) goes with the upgrade, and the fence would
stay for good, hanging the release's delete and its namespace's. The install
and its scope are read from the live Deployment's controller (`lookup`, which
reads nothing in helm template and helm lint).
*/}}
{{- define "flux-plunger.refuseStrandedFences" -}}
{{- $live := lookup "apps/v1" "Deployment" .Release.Namespace (include "flux-plunger.fullname" .) }}
{{- $new := .Values.controller.watchNamespaces | default list }}
{{- if and $live $new }}
{{- $old := list }}
{{- $lease := "" }}
{{- range (($live.spec).template.spec.containers | default list) }}
{{- if eq .name "flux-plunger" }}
{{- range (.args | default list) }}
{{- if hasPrefix "--watch-namespace=" . }}
{{- $old = append $old (trimPrefix "--watch-namespace=" .) }}
{{- else if hasPrefix "--leader-election-lease-name=" . }}
{{- $lease = trimPrefix "--leader-election-lease-name=" . }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- $install := include "flux-plunger.installOf" (dict "namespace" .Release.Namespace "lease" ($lease | default (include "flux-plunger.leaseName" .))) }}
{{- $releases := list }}
{{- if $old }}
{{- range $old }}
{{- if not (has . $new) }}
{{- $releases = concat $releases ((lookup "helm.toolkit.fluxcd.io/v2" "HelmRelease" . "").items | default list) }}
{{- end }}
{{- end }}
{{- else }}
{{- range ((lookup "helm.toolkit.fluxcd.io/v2" "HelmRelease" "" "").items | default list) }}
{{- if not (has .metadata.namespace $new) }}
{{- $releases = append $releases . }}
{{- end }}
{{- end }}
{{- end }}
{{- $stranded := list }}
{{- range $releases }}
{{- if and (has "flux-plunger.cozystack.io/uninstall-fence" (.metadata.finalizers | default list)) (has (index (.metadata.labels | default dict) "flux-plunger.cozystack.io/uninstall-fence" | default "") (list $install "held")) }}
{{- $stranded = append $stranded (printf "%s/%s" .metadata.namespace .metadata.name) }}
{{- end }}
{{- end }}
{{- if $stranded }}
{{- fail (printf "controller.watchNamespaces drops namespaces where this install still holds its uninstall fence on %s: the upgrade would take its access there away and leave the fence for good. Release them first (flux-plunger-sweep release NAMESPACE/NAME, see the chart README), or keep their namespaces until flux-plunger has let go of them" (join ", " $stranded)) }}
{{- end }}
{{- end }}
{{- end }}
