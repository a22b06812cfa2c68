# Helpers of the sweeper's bats suite: objects arranged with kubectl, the
# hook run as the chart's Job runs it (its args, its env, its ServiceAccount
# and RBAC rendered from chart/), and exact checks.
#
# No kube-controller-manager or kubelet runs: pods are created directly and
# scaling a Deployment deletes none of them; a pod whose spec.nodeName names
# a node that does not exist stays Terminating once deleted, as a pod on a
# NotReady node does.

KUBECTL=$FLUX_PLUNGER_OUT/bin/kubectl
HELM=$FLUX_PLUNGER_OUT/bin/helm
SWEEP=$ROOT/target/debug/flux-plunger-sweep
FENCE=flux-plunger.cozystack.io/uninstall-fence
HC_FINALIZER=finalizers.fluxcd.io
HR_API=helm.toolkit.fluxcd.io/v2
# helm keeps its cache and config under _out/, never in $HOME (as the Makefile).
export HELM_PLUGINS=$FLUX_PLUNGER_OUT/helm/plugins HELM_CACHE_HOME=$FLUX_PLUNGER_OUT/helm/cache \
  HELM_CONFIG_HOME=$FLUX_PLUNGER_OUT/helm/config HELM_DATA_HOME=$FLUX_PLUNGER_OUT/helm/data

k() { "$KUBECTL" "$@"; }

# A namespace of the test's own; the chart's release is named after it, so
# the hook's names are "$NS-flux-plunger" (Deployment, Lease) and
# "$NS-flux-plunger-pre-delete" (its ServiceAccount and roles).
new_namespace() {
  NS="t${BATS_SUITE_TEST_NUMBER}"
  FULLNAME="$NS-flux-plunger"
  HOOK="$FULLNAME-pre-delete"
  k create namespace "$NS" >/dev/null
}

# Leaves nothing for the next test, whose sweep or list sees every namespace:
# no release, so no fence and no suspension; no process of this test.
clear_namespace() {
  if [ -n "${HOOK_PID:-}" ] && kill -0 "$HOOK_PID" 2>/dev/null; then
    kill -TERM "$HOOK_PID"
    wait "$HOOK_PID" 2>/dev/null || true
  fi
  [ -n "${NS:-}" ] || return 0
  local name
  for name in $(k get helmreleases -n "$NS" -o name); do
    k patch "$name" -n "$NS" --type=merge -p '{"metadata":{"finalizers":null}}' >/dev/null
  done
  k delete helmreleases --all -n "$NS" --wait=false >/dev/null
  for _ in $(seq 1 50); do
    [ -z "$(k get helmreleases -n "$NS" -o name)" ] && return 0
    sleep 0.1
  done
  echo "releases left in $NS: $(k get helmreleases -n "$NS" -o name)" >&2
  return 1
}

# --- HelmReleases -----------------------------------------------------------

# A HelmRelease as a user writes it (a client-side create: no Apply entry).
release() {
  k create -n "$NS" -f - >/dev/null <<EOF
apiVersion: $HR_API
kind: HelmRelease
metadata:
  name: $1
spec:
  interval: 5m
  chart:
    spec:
      chart: demo
      sourceRef: {kind: HelmRepository, name: demo}
EOF
}

# Appends finalizer $2 to release $1 by an update (as helm-controller adds its own).
add_finalizer() {
  local op
  if [ -z "$(finalizers "$1")" ]; then
    op="{\"op\":\"add\",\"path\":\"/metadata/finalizers\",\"value\":[\"$2\"]}"
  else
    op="{\"op\":\"add\",\"path\":\"/metadata/finalizers/-\",\"value\":\"$2\"}"
  fi
  k patch helmrelease "$1" -n "$NS" --field-manager=helm-controller --type=json -p "[$op]" >/dev/null
}

# flux-plunger's fence on release $1 and, with --suspend, its suspension: one
# server-side apply by field manager flux-plunger, as a recovery takes them.
fence() {
  local spec=""
  [ "${2:-}" = --suspend ] && spec=$'\nspec:\n  suspend: true'
  k apply --server-side --field-manager=flux-plunger -n "$NS" -f - >/dev/null <<EOF
apiVersion: $HR_API
kind: HelmRelease
metadata:
  name: $1
  finalizers: [$FENCE]$spec
EOF
}

# Another applier ($2) applies the same spec.suspend: true to release $1: it
# now co-owns the suspension.
apply_suspend_as() {
  k apply --server-side --field-manager="$2" -n "$NS" -f - >/dev/null <<EOF
apiVersion: $HR_API
kind: HelmRelease
metadata:
  name: $1
spec:
  suspend: true
EOF
}

# An update setting spec.suspend: true on release $1, by field manager $2.
patch_suspend_as() {
  k patch helmrelease "$1" -n "$NS" --field-manager="$2" --type=merge -p '{"spec":{"suspend":true}}' >/dev/null
}

# Deletes release $1; its finalizers keep it, terminating.
delete_release() {
  k delete helmrelease "$1" -n "$NS" --wait=false >/dev/null
}

# What helm-controller leaves once it has handled the delete of release $1:
# its finalizer gone and the current generation observed.
helm_controller_handles_delete() {
  local index
  index=$(k get helmrelease "$1" -n "$NS" -o jsonpath='{.metadata.finalizers}' |
    tr -d '[]"' | tr ',' '\n' | grep -nx "$HC_FINALIZER" | cut -d: -f1)
  k patch helmrelease "$1" -n "$NS" --field-manager=helm-controller --type=json \
    -p "[{\"op\":\"test\",\"path\":\"/metadata/finalizers/$((index - 1))\",\"value\":\"$HC_FINALIZER\"},{\"op\":\"remove\",\"path\":\"/metadata/finalizers/$((index - 1))\"}]" >/dev/null
  k patch helmrelease "$1" -n "$NS" --field-manager=helm-controller --subresource=status --type=merge \
    -p "{\"status\":{\"observedGeneration\":$(hr "$1" '{.metadata.generation}')}}" >/dev/null
}

# A jsonpath of release $1 (nothing when the field is absent).
hr() { k get helmrelease "$1" -n "$NS" -o jsonpath="$2"; }
rv() { hr "$1" '{.metadata.resourceVersion}'; }
finalizers() { hr "$1" '{.metadata.finalizers}'; }
suspended() { hr "$1" '{.spec.suspend}'; }
# "manager/operation" of every managedFields entry owning spec.suspend, sorted.
suspend_owners() {
  hr "$1" "{range .metadata.managedFields[?(@.fieldsV1['f:spec']['f:suspend'])]}{.manager}/{.operation}{'\n'}{end}" |
    sort | paste -sd ' ' -
}
release_gone() { ! k get helmrelease "$1" -n "$NS" >/dev/null 2>&1; }

# "VERB NAME FIELD-MANAGER CODE BODY" of every write by the hook's
# ServiceAccount to $1 (a resource, or resource/subresource; helmreleases when
# not given), in order, from the apiserver's audit log (blocking mode: a
# request is logged before it is answered). BODY: json-patch, object, or -
# when the request was refused before its body was read.
hook_writes() {
  node -e '
    const [log, user, resource] = process.argv.slice(1);
    for (const line of require("fs").readFileSync(log, "utf8").split("\n")) {
      if (!line) continue;
      const e = JSON.parse(line);
      const ref = e.objectRef ?? {};
      const written = ref.subresource ? `${ref.resource}/${ref.subresource}` : ref.resource;
      if (e.user?.username !== user || written !== resource) continue;
      if (!["patch", "update", "create"].includes(e.verb)) continue;
      const manager = new URL(e.requestURI, "https://apiserver").searchParams.get("fieldManager") ?? "-";
      const body = e.requestObject === undefined ? "-" : Array.isArray(e.requestObject) ? "json-patch" : "object";
      console.log(e.verb, ref.name, manager, e.responseStatus.code, body);
    }' "$CONTROL_PLANE_DIR/audit.log" "system:serviceaccount:$NS:$HOOK" "${1:-helmreleases}"
}

# --- the chart's hook -------------------------------------------------------

CHART_KUBE_VERSION=1.29.0

# `helm template` of the chart for this test's release, for the local
# apiserver, which serves the API the admission guard needs (as its discovery
# tells helm install; the chart refuses to render its guard anywhere else).
chart_render() {
  "$HELM" template "$NS" "$ROOT/chart" --namespace "$NS" --kube-version "$CHART_KUBE_VERSION" \
    --api-versions admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy \
    --set logEncoding=console "$@"
}

hook_rbac_yaml() {
  chart_render --show-only templates/hook-serviceaccount.yaml \
    --show-only templates/hook-clusterrole.yaml --show-only templates/hook-clusterrolebinding.yaml \
    --show-only templates/hook-role.yaml --show-only templates/hook-rolebinding.yaml
}

# The hook's ServiceAccount and RBAC exactly as the chart renders them, under
# the chart's admission guard, and a kubeconfig with a token of that
# ServiceAccount (TokenRequest) in $HOOK_KUBECONFIG.
hook_identity() {
  grant_back
  local server ca token
  server=$(k config view --raw --minify -o jsonpath='{.clusters[0].cluster.server}')
  ca=$(k config view --raw --minify -o jsonpath='{.clusters[0].cluster.certificate-authority-data}')
  token=$(k create token "$HOOK" -n "$NS" --duration=1h)
  HOOK_KUBECONFIG="$BATS_TEST_TMPDIR/hook.kubeconfig"
  cat >"$HOOK_KUBECONFIG" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: local, cluster: {server: "$server", certificate-authority-data: "$ca"}}]
users: [{name: hook, user: {token: "$token"}}]
contexts: [{name: local, context: {cluster: local, user: hook}}]
current-context: local
EOF
  admission_guard
}

# The chart's admission guard for this test's release (rendered for the local
# apiserver, which serves the API it needs, as its discovery tells helm
# install), in force before the hook runs: until it is, the hook's dry-run
# delete of a Lease that is not its own passes; then the guard refuses it.
admission_guard() {
  local refused=""
  chart_render --show-only templates/admission-policy.yaml \
    --show-only templates/admission-policy-binding.yaml |
    k apply --server-side --field-manager=helm -f - >/dev/null
  k apply -n "$NS" -f - >/dev/null <<EOF
apiVersion: coordination.k8s.io/v1
kind: Lease
metadata:
  name: admission-guard-probe
EOF
  for _ in $(seq 1 600); do
    if ! KUBECONFIG=$HOOK_KUBECONFIG k delete lease admission-guard-probe -n "$NS" --dry-run=server \
      >/dev/null 2>"$BATS_TEST_TMPDIR/guard-probe.err" &&
      grep -qF "ValidatingAdmissionPolicy '$FULLNAME'" "$BATS_TEST_TMPDIR/guard-probe.err"; then
      refused=yes
      break
    fi
    sleep 0.1
  done
  [ -n "$refused" ] && return 0
  echo "the admission guard was not in force within 60 s: $(cat "$BATS_TEST_TMPDIR/guard-probe.err")" >&2
  return 1
}

# Applies the chart's hook RBAC again: what deny took away is given back.
grant_back() {
  hook_rbac_yaml | k apply --server-side --force-conflicts --field-manager=helm -f - >/dev/null
}

# Takes verb $3 off the rule for resource $2 of the hook's $1 (clusterrole or
# role), leaving the rest of the chart's RBAC as it is.
deny() {
  local kind=$1 resource=$2 verb=$3 index=0 found="" name verbs="" v
  while read -r name; do
    [ "$name" = "$resource" ] && found=$index && break
    index=$((index + 1))
  done < <(k get "$kind" "$HOOK" -n "$NS" -o jsonpath='{range .rules[*]}{.resources[0]}{"\n"}{end}')
  [ -n "$found" ] || { echo "no rule for $resource in $kind $HOOK" >&2; return 1; }
  for v in $(k get "$kind" "$HOOK" -n "$NS" -o jsonpath="{.rules[$found].verbs[*]}"); do
    [ "$v" = "$verb" ] || verbs="$verbs\"$v\","
  done
  local change="{\"op\":\"replace\",\"path\":\"/rules/$found/verbs\",\"value\":[${verbs%,}]}"
  # A rule must name a verb: one left without any goes.
  [ -n "$verbs" ] || change="{\"op\":\"remove\",\"path\":\"/rules/$found\"}"
  k patch "$kind" "$HOOK" -n "$NS" --type=json \
    -p "[{\"op\":\"test\",\"path\":\"/rules/$found/resources/0\",\"value\":\"$resource\"},$change]" >/dev/null
}

# The chart's Deployment of the controller (replicas 1), and its Lease.
controller_deployment() {
  chart_render --show-only templates/deployment.yaml | k create -f - >/dev/null
}
leader_lease() {
  k create -n "$NS" -f - >/dev/null <<EOF
apiVersion: coordination.k8s.io/v1
kind: Lease
metadata:
  name: $FULLNAME
spec:
  holderIdentity: $FULLNAME-7d9f-abcde
  leaseDurationSeconds: 27
EOF
}
replicas() { k get deployment "$FULLNAME" -n "$NS" -o jsonpath='{.spec.replicas}'; }
lease_exists() { k get lease "$FULLNAME" -n "$NS" >/dev/null 2>&1; }

# A controller pod (the Deployment's selector labels); on node $2 if given.
controller_pod() {
  local node=""
  [ -n "${2:-}" ] && node="nodeName: $2"
  k create -n "$NS" -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $1
  labels:
    app.kubernetes.io/name: flux-plunger
    app.kubernetes.io/instance: $NS
    app.kubernetes.io/component: controller
spec:
  $node
  containers: [{name: flux-plunger, image: flux-plunger}]
EOF
}

# The hook's argv as the chart's Job passes it (chart_render flags in "$@").
hook_args() {
  chart_render "$@" --show-only templates/hook-job.yaml |
    k create --dry-run=client -f - -o jsonpath='{range .spec.template.spec.containers[0].args[*]}{@}{"\n"}{end}'
}

# Runs flux-plunger-sweep as the hook Job's container would: its args, its
# POD_NAMESPACE, its ServiceAccount's token. "$@": chart_render flags.
sweep_hook() {
  local args
  mapfile -t args < <(hook_args "$@")
  [ "${args[0]}" = hook ] || { echo "unexpected hook args: ${args[*]}" >&2; return 1; }
  POD_NAMESPACE=$NS KUBECONFIG=$HOOK_KUBECONFIG "$SWEEP" "${args[@]}"
}

# The same in the background, its stdout and stderr in files; finish_hook
# waits for it and sets $status, $output and $stderr as `run` does.
sweep_hook_in_background() {
  local args
  mapfile -t args < <(hook_args "$@")
  POD_NAMESPACE=$NS KUBECONFIG=$HOOK_KUBECONFIG "$SWEEP" "${args[@]}" \
    >"$BATS_TEST_TMPDIR/hook.out" 2>"$BATS_TEST_TMPDIR/hook.err" 3>&- &
  HOOK_PID=$!
}
finish_hook() {
  status=0
  wait "$HOOK_PID" || status=$?
  output=$(cat "$BATS_TEST_TMPDIR/hook.out")
  stderr=$(cat "$BATS_TEST_TMPDIR/hook.err")
}
# Waits (at most 30 s) until the background hook has logged $1.
hook_logged() {
  for _ in $(seq 1 300); do
    grep -qF -- "$1" "$BATS_TEST_TMPDIR/hook.err" && return 0
    kill -0 "$HOOK_PID" 2>/dev/null || break
    sleep 0.1
  done
  echo "the hook did not log \"$1\":" >&2
  cat "$BATS_TEST_TMPDIR/hook.err" >&2
  return 1
}

# `flux-plunger-sweep ARGS` as an operator runs it, with the admin kubeconfig.
sweep() { "$SWEEP" "$@"; }

# --- checks -----------------------------------------------------------------

# The exit status of the last `run`, or an explanation.
expect_status() {
  [ "$status" -eq "$1" ] && return 0
  echo "exit status $status, expected $1" >&2
  echo "-- stdout:" >&2; printf '%s\n' "$output" >&2
  echo "-- stderr:" >&2; printf '%s\n' "${stderr:-}" >&2
  return 1
}

# stdout of the last `run`, exactly as on stdin.
expect_output() {
  local want
  want=$(cat)
  [ "$output" = "$want" ] && return 0
  echo "-- stdout differs (- expected, + actual):" >&2
  diff -u <(printf '%s\n' "$want") <(printf '%s\n' "$output") | tail -n +3 >&2
  echo "-- stderr:" >&2; printf '%s\n' "${stderr:-}" >&2
  return 1
}

# expect_eq WHAT ACTUAL EXPECTED
expect_eq() {
  [ "$2" = "$3" ] && return 0
  printf '%s: got [%s], expected [%s]\n' "$1" "$2" "$3" >&2
  return 1
}
