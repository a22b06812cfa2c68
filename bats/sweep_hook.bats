#!/usr/bin/env bats
# flux-plunger-sweep as the chart's pre-delete hook (SPEC §8): the real binary
# with the Job's args and env, under the hook's ServiceAccount and the chart's
# RBAC for it, against the local control plane.

bats_require_minimum_version 1.5.0

setup() {
  load helpers
  new_namespace
  hook_identity
}

teardown() {
  clear_namespace
}

@test "the hook lifts only suspensions flux-plunger alone holds by an apply, and removes every fence, a doubled one too" {
  controller_deployment
  leader_lease
  release ours
  add_finalizer ours "$HC_FINALIZER"
  fence ours --suspend
  release co-owned
  fence co-owned --suspend
  apply_suspend_as co-owned migration
  release patched
  patch_suspend_as patched kubectl-patch
  fence patched
  release doubled
  fence doubled
  add_finalizer doubled "$HC_FINALIZER"
  add_finalizer doubled "$FENCE"
  release bystander
  patch_suspend_as bystander kubectl-patch
  expect_eq "doubled before" "$(finalizers doubled)" "[\"$FENCE\",\"$HC_FINALIZER\",\"$FENCE\"]"
  expect_eq "co-owned before" "$(suspend_owners co-owned)" "flux-plunger/Apply migration/Apply"
  bystander_rv=$(rv bystander)

  run --separate-stderr sweep_hook

  expect_status 0
  expect_output <<EOF
scaled Deployment $NS/$FULLNAME to 0
released $NS/co-owned
released $NS/doubled
released $NS/ours
released $NS/patched
released 4 of 4 fenced HelmReleases, 0 without an uninstall
removed the leader Lease $NS/$FULLNAME
every fence was released
EOF
  expect_eq "ours: suspension" "$(suspended ours)" ""
  expect_eq "ours: finalizers" "$(finalizers ours)" "[\"$HC_FINALIZER\"]"
  expect_eq "co-owned: suspension" "$(suspended co-owned)" "true"
  expect_eq "co-owned: finalizers" "$(finalizers co-owned)" ""
  expect_eq "patched: suspension" "$(suspended patched)" "true"
  expect_eq "patched: owners" "$(suspend_owners patched)" "kubectl-patch/Update"
  expect_eq "patched: finalizers" "$(finalizers patched)" ""
  expect_eq "doubled: finalizers" "$(finalizers doubled)" "[\"$HC_FINALIZER\"]"
  expect_eq "bystander: untouched" "$(rv bystander)" "$bystander_rv"
  # One guarded JSON patch a release by the sweep's own manager, never an apply.
  expect_eq "the hook's writes" "$(hook_writes)" "patch co-owned flux-plunger-sweep 200 json-patch
patch doubled flux-plunger-sweep 200 json-patch
patch ours flux-plunger-sweep 200 json-patch
patch patched flux-plunger-sweep 200 json-patch"
  expect_eq "replicas" "$(replicas)" "0"
  expect_eq "the hook's scale-down" "$(hook_writes deployments/scale | cut -d' ' -f1-4)" \
    "patch $FULLNAME flux-plunger-sweep 200"
  ! lease_exists
}

@test "a deleted release helm-controller has not uninstalled is released and named WITHOUT an uninstall" {
  release pending
  add_finalizer pending "$HC_FINALIZER"
  fence pending
  delete_release pending
  release handled
  add_finalizer handled "$HC_FINALIZER"
  fence handled
  delete_release handled
  helm_controller_handles_delete handled

  run --separate-stderr sweep_hook

  expect_status 0
  expect_output <<EOF
no Deployment $NS/$FULLNAME: nothing to stop
released $NS/handled
released $NS/pending WITHOUT an uninstall: it was being deleted and helm-controller had not uninstalled it; its resources may be left
released 2 of 2 fenced HelmReleases, 1 without an uninstall
every fence was released
EOF
  release_gone handled
  expect_eq "pending: finalizers" "$(finalizers pending)" "[\"$HC_FINALIZER\"]"
}

@test "with no Deployment there is nothing to stop, and the hook releases every fence" {
  release web
  fence web --suspend

  run --separate-stderr sweep_hook

  expect_status 0
  expect_output <<EOF
no Deployment $NS/$FULLNAME: nothing to stop
released $NS/web
released 1 of 1 fenced HelmReleases, 0 without an uninstall
every fence was released
EOF
  expect_eq "finalizers" "$(finalizers web)" ""
  expect_eq "suspension" "$(suspended web)" ""
}

@test "a patch refused until RBAC grants it a few seconds into the run is retried, and every fence is released" {
  controller_deployment
  release ours
  fence ours --suspend
  release bare
  fence bare
  deny clusterrole helmreleases patch
  export FLUX_PLUNGER_TEST_HOOK_RETRY_WINDOW_SECONDS=30

  sweep_hook_in_background
  hook_logged "releasing failed; reading again"
  sleep 2
  grant_back
  finish_hook

  expect_status 0
  expect_output <<EOF
scaled Deployment $NS/$FULLNAME to 0
released $NS/bare
released $NS/ours
released 2 of 2 fenced HelmReleases, 0 without an uninstall
every fence was released
EOF
  [[ "$stderr" == *'cannot patch resource "helmreleases"'* ]]
  expect_eq "ours: suspension" "$(suspended ours)" ""
  expect_eq "ours: finalizers" "$(finalizers ours)" ""
  expect_eq "bare: finalizers" "$(finalizers bare)" ""
}

@test "a patch never granted fails the hook, names each release NOT released and leaves the suspension in place" {
  controller_deployment
  leader_lease
  release ours
  fence ours --suspend
  release bare
  fence bare
  before="$(rv ours) $(rv bare)"
  deny clusterrole helmreleases patch
  export FLUX_PLUNGER_TEST_HOOK_RETRY_WINDOW_SECONDS=2

  run --separate-stderr sweep_hook

  expect_status 1
  forbidden="is forbidden: User \"system:serviceaccount:$NS:$HOOK\" cannot patch resource \"helmreleases\" in API group \"helm.toolkit.fluxcd.io\" in the namespace \"$NS\" (403 Forbidden)"
  expect_output <<EOF
scaled Deployment $NS/$FULLNAME to 0
NOT released $NS/bare: helmreleases.helm.toolkit.fluxcd.io "bare" $forbidden
NOT released $NS/ours: helmreleases.helm.toolkit.fluxcd.io "ours" $forbidden
released 0 of 2 fenced HelmReleases, 0 without an uninstall
removed the leader Lease $NS/$FULLNAME
failing the hook so that helm-controller retries the uninstall (hook included) instead of stranding a fence
EOF
  expect_eq "nothing written" "$(rv ours) $(rv bare)" "$before"
  # Every patch refused. The releases share one window: the first one's
  # retries used it up, the second had its one attempt after it.
  expect_eq "the hook's writes" "$(hook_writes | uniq -c | awk '{print $2, $3, $4, $5, $6, ($1 > 1 ? "retried" : "once")}')" \
    "patch bare flux-plunger-sweep 403 - retried
patch ours flux-plunger-sweep 403 - once"
  expect_eq "ours: suspension" "$(suspended ours)" "true"
  expect_eq "ours: owners" "$(suspend_owners ours)" "flux-plunger/Apply"
  expect_eq "ours: finalizers" "$(finalizers ours)" "[\"$FENCE\"]"
}

@test "a listing that never succeeds fails the hook, and no fence was touched" {
  controller_deployment
  release web
  fence web --suspend
  before=$(rv web)
  deny clusterrole helmreleases list
  export FLUX_PLUNGER_TEST_HOOK_RETRY_WINDOW_SECONDS=2

  run --separate-stderr sweep_hook

  expect_status 1
  expect_output <<EOF
scaled Deployment $NS/$FULLNAME to 0
could not list HelmReleases: helmreleases.helm.toolkit.fluxcd.io is forbidden: User "system:serviceaccount:$NS:$HOOK" cannot list resource "helmreleases" in API group "helm.toolkit.fluxcd.io" at the cluster scope (403 Forbidden); no fence was touched
failing the hook so that helm-controller retries the uninstall (hook included) instead of stranding a fence
EOF
  expect_eq "nothing written" "$(rv web)" "$before"
}

@test "a Deployment that cannot be read fails the hook before anything is touched" {
  controller_deployment
  leader_lease
  release web
  fence web --suspend
  before=$(rv web)
  deny role deployments get
  export FLUX_PLUNGER_TEST_HOOK_RETRY_WINDOW_SECONDS=2

  run --separate-stderr sweep_hook

  expect_status 1
  expect_output <<EOF
could not read Deployment $NS/$FULLNAME: deployments.apps "$FULLNAME" is forbidden: User "system:serviceaccount:$NS:$HOOK" cannot get resource "deployments" in API group "apps" in the namespace "$NS" (403 Forbidden); no fence was touched
failing the hook so that helm-controller retries the uninstall (hook included) instead of stranding a fence
EOF
  expect_eq "nothing written" "$(rv web)" "$before"
  expect_eq "replicas" "$(replicas)" "1"
  lease_exists
}

@test "a Deployment that cannot be scaled fails the hook before any fence is touched" {
  controller_deployment
  leader_lease
  release web
  fence web --suspend
  before=$(rv web)
  deny role deployments/scale patch
  export FLUX_PLUNGER_TEST_HOOK_RETRY_WINDOW_SECONDS=2

  run --separate-stderr sweep_hook

  expect_status 1
  expect_output <<EOF
could not scale Deployment $NS/$FULLNAME to 0: deployments.apps "$FULLNAME" is forbidden: User "system:serviceaccount:$NS:$HOOK" cannot patch resource "deployments/scale" in API group "apps" in the namespace "$NS" (403 Forbidden); no fence was touched
failing the hook so that helm-controller retries the uninstall (hook included) instead of stranding a fence
EOF
  expect_eq "nothing written" "$(rv web)" "$before"
  expect_eq "replicas" "$(replicas)" "1"
  lease_exists
}

@test "the hook waits for the controller's pods, and once none is left removes the leader Lease" {
  controller_deployment
  leader_lease
  controller_pod "$FULLNAME-7d9f-abcde"
  release web
  fence web
  # The pod goes after a second; a hook that missed it fails within 30 s.
  export FLUX_PLUNGER_TEST_HOOK_POD_WAIT_SECONDS=30

  sweep_hook_in_background
  hook_logged "scaled Deployment $NS/$FULLNAME to 0"
  sleep 1
  # What the ReplicaSet controller and the kubelet would do after the scale.
  k delete pod "$FULLNAME-7d9f-abcde" -n "$NS" --wait=false >/dev/null
  finish_hook

  expect_status 0
  expect_output <<EOF
scaled Deployment $NS/$FULLNAME to 0
released $NS/web
released 1 of 1 fenced HelmReleases, 0 without an uninstall
removed the leader Lease $NS/$FULLNAME
every fence was released
EOF
  ! lease_exists
}

@test "a pod stuck Terminating is reported, the sweep goes on, and the Lease is kept" {
  controller_deployment
  leader_lease
  controller_pod "$FULLNAME-7d9f-abcde" node-gone-notready
  k delete pod "$FULLNAME-7d9f-abcde" -n "$NS" --wait=false >/dev/null
  release web
  fence web --suspend
  export FLUX_PLUNGER_TEST_HOOK_POD_WAIT_SECONDS=1

  run --separate-stderr sweep_hook

  expect_status 0
  expect_output <<EOF
scaled Deployment $NS/$FULLNAME to 0
pod $NS/$FULLNAME-7d9f-abcde is still there after the wait (stuck Terminating on a NotReady node?): going on; it may still set fences
released $NS/web
released 1 of 1 fenced HelmReleases, 0 without an uninstall
every fence was released
EOF
  expect_eq "finalizers" "$(finalizers web)" ""
  [ -n "$(k get pod "$FULLNAME-7d9f-abcde" -n "$NS" -o jsonpath='{.metadata.deletionTimestamp}')" ]
  lease_exists
}

@test "a fence set after the listing while a pod may still run fails the hook" {
  controller_deployment
  controller_pod "$FULLNAME-7d9f-abcde" node-gone-notready
  k delete pod "$FULLNAME-7d9f-abcde" -n "$NS" --wait=false >/dev/null
  release early
  fence early
  release late
  deny clusterrole helmreleases patch
  export FLUX_PLUNGER_TEST_HOOK_POD_WAIT_SECONDS=1 FLUX_PLUNGER_TEST_HOOK_RETRY_WINDOW_SECONDS=30

  sweep_hook_in_background
  # The listing is done and the first patch refused: the stuck pod fences
  # another release now.
  hook_logged "releasing failed; reading again"
  fence late
  grant_back
  finish_hook

  expect_status 1
  expect_output <<EOF
scaled Deployment $NS/$FULLNAME to 0
pod $NS/$FULLNAME-7d9f-abcde is still there after the wait (stuck Terminating on a NotReady node?): going on; it may still set fences
released $NS/early
released 1 of 1 fenced HelmReleases, 0 without an uninstall
fences found after the sweep while a flux-plunger pod may still run: $NS/late
failing the hook so that helm-controller retries the uninstall (hook included) instead of stranding a fence
EOF
  expect_eq "early: finalizers" "$(finalizers early)" ""
  expect_eq "late: finalizers" "$(finalizers late)" "[\"$FENCE\"]"
}

@test "pods that cannot be listed count as pods that may still run" {
  controller_deployment
  leader_lease
  release web
  fence web
  deny role pods list
  export FLUX_PLUNGER_TEST_HOOK_POD_WAIT_SECONDS=1

  run --separate-stderr sweep_hook

  expect_status 0
  selector="app.kubernetes.io/component=controller,app.kubernetes.io/instance=$NS,app.kubernetes.io/name=flux-plunger"
  expect_output <<EOF
scaled Deployment $NS/$FULLNAME to 0
could not list the flux-plunger pods ($selector): pods is forbidden: User "system:serviceaccount:$NS:$HOOK" cannot list resource "pods" in API group "" in the namespace "$NS" (403 Forbidden); going on as if one may still run
released $NS/web
released 1 of 1 fenced HelmReleases, 0 without an uninstall
every fence was released
EOF
  lease_exists
}

@test "the pod wait is cut at the end of the retry window, whatever the grace period" {
  controller_deployment
  controller_pod "$FULLNAME-7d9f-abcde" node-gone-notready
  k delete pod "$FULLNAME-7d9f-abcde" -n "$NS" --wait=false >/dev/null
  release web
  export FLUX_PLUNGER_TEST_HOOK_RETRY_WINDOW_SECONDS=3

  for grace in 40 140; do
    fence web
    mapfile -t args < <(hook_args --set shutdownGracePeriodSeconds="$grace")
    expect_eq "G=$grace: the Job's flag" "${args[6]}" "--shutdown-grace-period-seconds=$grace"
    started=$(date +%s%N)
    run --separate-stderr env POD_NAMESPACE="$NS" KUBECONFIG="$HOOK_KUBECONFIG" "$SWEEP" "${args[@]}"
    took_ms=$((($(date +%s%N) - started) / 1000000))

    expect_status 0
    expect_output <<EOF
scaled Deployment $NS/$FULLNAME to 0
pod $NS/$FULLNAME-7d9f-abcde is still there after the wait (stuck Terminating on a NotReady node?): going on; it may still set fences
released $NS/web
released 1 of 1 fenced HelmReleases, 0 without an uninstall
every fence was released
EOF
    # A pod wait of G + 10 s (50 s, 150 s) cut at the 3 s window; the rest
    # (one listing, one patch, the listing again) is quick.
    if [ "$took_ms" -lt 3000 ] || [ "$took_ms" -ge 5000 ]; then
      echo "G=$grace: the run took ${took_ms} ms, expected 3 s to 5 s" >&2
      return 1
    fi
  done
}
