//! The chart against the code: every duration it renders is the one
//! `plunger::timings` derives, every container's argv parses with that
//! binary's own clap definition, the names it wires together agree, and its
//! RBAC names the resources `plunger::names` names. Change either side alone
//! and a test here goes red.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use chart_contract::{
    Manifests, Render, container, is_hook, name, parse_selector, pod_argv, string_map,
};
use clap::{CommandFactory, Parser, ValueEnum};
use plunger::cli::{LogEncoding, LogLevel};
use plunger::names;
use plunger::timings::{GracePeriodError, HELM_CONTROLLER_UNINSTALL_TIMEOUT, Timings};
use serde_json::Value;

const RELEASE: &str = "plunger";
const NAMESPACE: &str = "flux-system";
/// What the downward API would give `metadata.name` in a pod.
const POD_NAME: &str = "plunger-flux-plunger-5d8c7b9f4-x2x9q";

/// The accepted grace periods the contract is checked at: both ends and the
/// default.
const GRACE_PERIODS: [u64; 3] = [40, 90, 140];

fn downward_api(path: &str) -> Option<String> {
    match path {
        "metadata.name" => Some(POD_NAME.to_owned()),
        "metadata.namespace" => Some(NAMESPACE.to_owned()),
        _ => None,
    }
}

fn render_with_grace(g: u64) -> Result<Manifests> {
    Render::new(RELEASE, NAMESPACE)
        .set(&format!("shutdownGracePeriodSeconds={g}"))
        .manifests()
}

fn seconds(value: &Value, what: &str) -> Result<Duration> {
    value
        .as_u64()
        .map(Duration::from_secs)
        .with_context(|| format!("{what} is not a whole number of seconds: {value}"))
}

fn deployment(manifests: &Manifests) -> Result<&Value> {
    manifests.one("Deployment", false)
}

fn hook_job(manifests: &Manifests) -> Result<&Value> {
    manifests.one("Job", true)
}

fn pod_spec(workload: &Value) -> &Value {
    &workload["spec"]["template"]["spec"]
}

/// The variables a binary reads itself rather than through a flag: `RUST_LOG`,
/// which `plunger::cli::LogArgs::init` takes as the whole log filter (the
/// chart's `extraEnv` sets it). [`pod_argv`] refuses a variable no flag
/// reads, so these are left out of what it is given.
const READ_BY_THE_PROCESS: [&str; 1] = ["RUST_LOG"];

/// `container` without its [`READ_BY_THE_PROCESS`] variables.
fn without_process_env(container: &Value) -> Value {
    let mut container = container.clone();
    if let Some(env) = container["env"].as_array_mut() {
        env.retain(|var| {
            !READ_BY_THE_PROCESS
                .iter()
                .any(|name| var["name"].as_str() == Some(*name))
        });
    }
    container
}

fn controller_args(manifests: &Manifests) -> Result<flux_plunger::cli::Args> {
    let argv = pod_argv(
        &flux_plunger::cli::Args::command(),
        &without_process_env(container(pod_spec(deployment(manifests)?), "flux-plunger")?),
        downward_api,
    )?;
    flux_plunger::cli::Args::try_parse_from(&argv)
        .with_context(|| format!("flux-plunger refuses the chart's argv {argv:?}"))
}

fn drain_args(manifests: &Manifests) -> Result<flux_plunger_drain::cli::Args> {
    let argv = pod_argv(
        &flux_plunger_drain::cli::Args::command(),
        &without_process_env(container(
            pod_spec(deployment(manifests)?),
            "flux-plunger-drain",
        )?),
        downward_api,
    )?;
    flux_plunger_drain::cli::Args::try_parse_from(&argv)
        .with_context(|| format!("flux-plunger-drain refuses the chart's argv {argv:?}"))
}

fn hook_args(manifests: &Manifests) -> Result<flux_plunger_sweep::cli::HookArgs> {
    let argv = pod_argv(
        &flux_plunger_sweep::cli::Args::command(),
        &without_process_env(container(
            pod_spec(hook_job(manifests)?),
            "flux-plunger-sweep",
        )?),
        downward_api,
    )?;
    let args = flux_plunger_sweep::cli::Args::try_parse_from(&argv)
        .with_context(|| format!("flux-plunger-sweep refuses the chart's argv {argv:?}"))?;
    match args.command {
        Some(flux_plunger_sweep::cli::Command::Hook(hook)) => Ok(hook),
        other => anyhow::bail!("the hook Job runs {other:?}, not `flux-plunger-sweep hook`"),
    }
}

#[test]
fn every_duration_the_chart_renders_is_the_one_timings_derives() -> Result<()> {
    for g in GRACE_PERIODS {
        let timings = Timings::from_grace_period(g)?;
        let manifests = render_with_grace(g)?;
        let pod = pod_spec(deployment(&manifests)?);
        assert_eq!(
            seconds(
                &pod["terminationGracePeriodSeconds"],
                "terminationGracePeriodSeconds"
            )?,
            timings.grace_period,
            "G={g}"
        );
        let job = hook_job(&manifests)?;
        assert_eq!(
            seconds(
                &job["spec"]["activeDeadlineSeconds"],
                "activeDeadlineSeconds"
            )?,
            timings.hook_active_deadline,
            "G={g}"
        );
        assert!(
            timings.hook_active_deadline < HELM_CONTROLLER_UNINSTALL_TIMEOUT,
            "the Job must end before helm-controller gives up on the uninstall"
        );
        assert_eq!(
            seconds(
                &job["spec"]["ttlSecondsAfterFinished"],
                "ttlSecondsAfterFinished"
            )?,
            timings.hook_ttl_after_finished,
            "G={g}"
        );
        assert_eq!(job["spec"]["backoffLimit"], 0, "G={g}: the hook runs once");
    }
    Ok(())
}

#[test]
fn the_controller_parses_the_chart_s_flags_with_the_grace_period_and_the_lease() -> Result<()> {
    for g in GRACE_PERIODS {
        let manifests = render_with_grace(g)?;
        let args = controller_args(&manifests)?;
        let timings = args.grace.timings;
        assert_eq!(timings, Timings::from_grace_period(g)?, "G={g}");
        assert_eq!(timings.grace_period.as_secs(), g);
        assert_eq!(timings.drain_deadline.as_secs(), g - 25, "G={g}");
        assert!(args.leader_elect, "G={g}: leader election must be on");
        assert_eq!(
            args.lease.leader_election_lease_name,
            "plunger-flux-plunger"
        );
        assert_eq!(
            args.lease.leader_election_namespace.as_deref(),
            Some(NAMESPACE)
        );
        assert_eq!(args.lease.identity(), POD_NAME);
        assert_eq!(args.log.log_level, LogLevel::Info);
        assert_eq!(args.log.log_encoding, LogEncoding::Json);
        assert_eq!(args.concurrent, 4);
    }
    Ok(())
}

#[test]
fn the_drain_parses_the_chart_s_flags_with_the_grace_period_and_the_lease() -> Result<()> {
    for g in GRACE_PERIODS {
        let manifests = render_with_grace(g)?;
        let args = drain_args(&manifests)?;
        let timings = args.grace.timings;
        assert_eq!(timings, Timings::from_grace_period(g)?, "G={g}");
        assert_eq!(timings.drain_deadline.as_secs(), g - 25, "G={g}");
        assert_eq!(
            args.lease.leader_election_lease_name,
            "plunger-flux-plunger"
        );
        assert_eq!(
            args.lease.leader_election_namespace.as_deref(),
            Some(NAMESPACE)
        );
        assert_eq!(args.lease.identity(), POD_NAME);
        assert_eq!(args.concurrent, 16);
        let drain = container(pod_spec(deployment(&manifests)?), "flux-plunger-drain")?;
        assert_eq!(
            drain["restartPolicy"], "Always",
            "the drain must be a native sidecar, stopped after the controller"
        );
    }
    Ok(())
}

#[test]
fn the_sweep_parses_the_hook_s_flags_and_targets_this_release_s_deployment_pods_and_lease()
-> Result<()> {
    for g in GRACE_PERIODS {
        let manifests = render_with_grace(g)?;
        let hook = hook_args(&manifests)?;
        let timings = hook.grace.timings;
        assert_eq!(timings, Timings::from_grace_period(g)?, "G={g}");
        assert_eq!(timings.drain_deadline.as_secs(), g - 25, "G={g}");
        assert_eq!(hook.log.log_encoding, LogEncoding::Json);

        let deployment = deployment(&manifests)?;
        assert_eq!(hook.namespace.as_deref(), Some(NAMESPACE));
        assert_eq!(hook.deployment, name(deployment));
        let selector = string_map(&deployment["spec"]["selector"]["matchLabels"]);
        assert_eq!(parse_selector(&hook.pod_selector)?, selector);
        let controller = controller_args(&manifests)?;
        assert_eq!(
            hook.leader_election_lease_name,
            controller.lease.leader_election_lease_name
        );
    }
    Ok(())
}

#[test]
fn every_value_set_renders_flags_the_binaries_accept() -> Result<()> {
    let manifests = Render::new(RELEASE, NAMESPACE)
        .values("everything.yaml")
        .manifests()?;
    let controller = controller_args(&manifests)?;
    let drain = drain_args(&manifests)?;
    let hook = hook_args(&manifests)?;
    let g140 = Timings::from_grace_period(140)?;
    assert_eq!(controller.grace.timings, g140);
    assert_eq!(drain.grace.timings, g140);
    assert_eq!(hook.grace.timings, g140);
    for lease in [
        &controller.lease.leader_election_lease_name,
        &drain.lease.leader_election_lease_name,
        &hook.leader_election_lease_name,
    ] {
        assert_eq!(lease, "flux-plunger-leader");
    }
    for log in [&controller.log, &drain.log, &hook.log] {
        assert_eq!(log.log_level, LogLevel::Debug);
        assert_eq!(log.log_encoding, LogEncoding::Console);
    }
    assert_eq!(controller.concurrent, 8);
    assert!(controller.dry_run);
    // The drain and the hook act within the controller's scope.
    let scope = plunger::scope::Scope {
        namespaces: vec!["apps".into(), "payments".into()],
        label_selector: Some("team=payments".into()),
    };
    assert_eq!(controller.scope.scope(), scope);
    assert_eq!(drain.scope.scope(), scope);
    assert_eq!(hook.scope.scope(), scope);
    assert_eq!(controller.max_recoveries_per_minute, 12);
    let notification = "http://notification-controller.flux-system.svc.cluster.local./";
    assert_eq!(controller.events.events_addr.as_deref(), Some(notification));
    assert_eq!(drain.events.events_addr.as_deref(), Some(notification));
    assert_eq!(drain.concurrent, 32);
    assert_eq!(hook.deployment, "plunger");
    Ok(())
}

/// `extraEnv` reaches every container, and what it is for: `RUST_LOG` is
/// read by the binaries themselves (the set [`READ_BY_THE_PROCESS`] leaves
/// out of the argv is really read).
#[test]
fn extra_env_reaches_every_container_and_rust_log_is_read_by_the_binaries() -> Result<()> {
    let manifests = Render::new(RELEASE, NAMESPACE)
        .values("everything.yaml")
        .manifests()?;
    let pod = pod_spec(deployment(&manifests)?);
    let job = hook_job(&manifests)?;
    for container in [
        container(pod, "flux-plunger")?,
        container(pod, "flux-plunger-drain")?,
        container(pod_spec(job), "flux-plunger-sweep")?,
    ] {
        let names: Vec<&str> = container["env"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|var| var["name"].as_str())
            .collect();
        assert!(
            names.contains(&"RUST_LOG"),
            "{}: {names:?}",
            container["name"]
        );
    }
    let log_init = include_str!("../../../crates/plunger/src/cli.rs");
    for name in READ_BY_THE_PROCESS {
        assert!(
            log_init.contains(&format!("std::env::var(\"{name}\")")),
            "plunger::cli no longer reads {name}"
        );
    }
    Ok(())
}

/// Every flag of the controller is either the chart's (it passes it, or a
/// value stands for it), which `extraArgs` may not repeat, or one left to
/// `extraArgs`. A flag added to the controller fails this test until the
/// chart passes it or it is listed here.
#[test]
fn extra_args_may_name_no_flag_the_chart_passes() -> Result<()> {
    const LEFT_TO_EXTRA_ARGS: [&str; 1] = ["kubeconfig"];
    let command = flux_plunger::cli::Args::command();
    let mut accepted = BTreeSet::new();
    let mut refused = BTreeSet::new();
    for arg in command.get_arguments() {
        let Some(long) = arg.get_long().filter(|l| !["help", "version"].contains(l)) else {
            continue;
        };
        let aliases = arg.get_all_aliases().unwrap_or_default();
        for flag in std::iter::once(long).chain(aliases) {
            let render = Render::new(RELEASE, NAMESPACE).set(&format!("extraArgs[0]=--{flag}=x"));
            match render.yaml() {
                Ok(_) => {
                    accepted.insert(flag.to_owned());
                }
                Err(err) => {
                    let refusal = format!("extraArgs: --{flag} is the chart's to pass");
                    ensure!(format!("{err:#}").contains(&refusal), "--{flag}: {err:#}");
                    refused.insert(flag.to_owned());
                }
            }
        }
    }
    assert_eq!(
        accepted,
        LEFT_TO_EXTRA_ARGS.iter().map(|f| (*f).to_owned()).collect(),
        "refused: {refused:?}"
    );
    for flag in [
        "concurrent",
        "watch-namespace",
        "pod-name",
        "enable-leader-election",
    ] {
        assert!(refused.contains(flag), "{flag}: {refused:?}");
    }
    Ok(())
}

#[test]
fn the_controller_listens_where_the_pod_s_ports_probes_and_service_point() -> Result<()> {
    let manifests = Render::new(RELEASE, NAMESPACE).manifests()?;
    let args = controller_args(&manifests)?;
    let controller = container(pod_spec(deployment(&manifests)?), "flux-plunger")?;
    let port_named = |port_name: &str| -> Result<u16> {
        let port = controller["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["name"] == port_name)
            .with_context(|| format!("no container port named {port_name}"))?;
        Ok(u16::try_from(
            port["containerPort"].as_u64().unwrap_or_default(),
        )?)
    };
    assert_eq!(port_named("metrics")?, args.metrics_addr.port());
    assert_eq!(port_named("health")?, args.health_addr.port());
    assert!(
        args.metrics_addr.ip().is_unspecified(),
        "metrics on every interface"
    );
    assert!(
        args.health_addr.ip().is_unspecified(),
        "probes on every interface"
    );
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        let http = &controller[probe]["httpGet"];
        assert_eq!(http["path"], path);
        let port = http["port"].as_str().context("probe port by name")?;
        assert_eq!(port_named(port)?, args.health_addr.port(), "{probe}");
    }
    let service = manifests.one("Service", false)?;
    let target = service["spec"]["ports"][0]["targetPort"]
        .as_str()
        .context("Service targetPort by name")?;
    assert_eq!(port_named(target)?, args.metrics_addr.port());
    Ok(())
}

/// Every binding that is (`hook == true`) or is not a Helm hook grants
/// `account` alone a role that exists, in the binding's own namespace for a
/// Role: one ClusterRoleBinding and the Lease's RoleBinding, or with
/// `controller.watchNamespaces` no ClusterRoleBinding and a RoleBinding in
/// each namespace of the scope as well.
fn check_bindings(manifests: &Manifests, account: &Value, hook: bool) -> Result<()> {
    let scoped = serde_json::to_string(deployment(manifests)?)?.contains("--watch-namespace=");
    let bindings: Vec<&Value> = ["ClusterRoleBinding", "RoleBinding"]
        .into_iter()
        .flat_map(|kind| manifests.of_kind(kind))
        .filter(|b| is_hook(b) == hook)
        .collect();
    let cluster_wide = bindings
        .iter()
        .filter(|b| b["kind"] == "ClusterRoleBinding")
        .count();
    assert_eq!(cluster_wide, usize::from(!scoped), "hook: {hook}");
    assert!(bindings.len() >= 2, "hook: {hook}: {bindings:?}");
    for binding in bindings {
        let what = format!("hook: {hook}, {} {}", binding["kind"], name(binding));
        assert_eq!(
            binding["subjects"],
            serde_json::json!([{"kind": "ServiceAccount", "name": name(account), "namespace": NAMESPACE}]),
            "{what}"
        );
        let role_kind = binding["roleRef"]["kind"].as_str().unwrap_or_default();
        let roles: Vec<&Value> = manifests
            .of_kind(role_kind)
            .filter(|r| is_hook(r) == hook && r["metadata"]["name"] == binding["roleRef"]["name"])
            .filter(|r| {
                role_kind == "ClusterRole"
                    || r["metadata"]["namespace"] == binding["metadata"]["namespace"]
            })
            .collect();
        assert_eq!(roles.len(), 1, "{what}: its {role_kind}");
    }
    Ok(())
}

#[test]
fn the_objects_point_at_each_other_by_the_names_they_carry() -> Result<()> {
    for render in [
        Render::new(RELEASE, NAMESPACE),
        Render::new(RELEASE, NAMESPACE).values("everything.yaml"),
        Render::new("flux-plunger", NAMESPACE).set("nameOverride=plunger-x"),
    ] {
        let manifests = render.manifests()?;
        let deployment = deployment(&manifests)?;
        let pod = pod_spec(deployment);

        // The controller's ServiceAccount: the pod runs as it, the bindings
        // grant it the roles, and the roles exist.
        let account = manifests.one("ServiceAccount", false)?;
        assert_eq!(pod["serviceAccountName"], name(account));
        check_bindings(&manifests, account, false)?;

        // The hook's ServiceAccount, likewise.
        let job = hook_job(&manifests)?;
        let hook_account = manifests.one("ServiceAccount", true)?;
        assert_eq!(pod_spec(job)["serviceAccountName"], name(hook_account));
        check_bindings(&manifests, hook_account, true)?;

        // The selector: the Deployment's own pods, the metrics Service, and the
        // hook's --pod-selector; never the hook's own pod.
        let selector = string_map(&deployment["spec"]["selector"]["matchLabels"]);
        let selects = |labels: &BTreeMap<String, String>| {
            selector.iter().all(|(k, v)| labels.get(k) == Some(v))
        };
        assert!(selects(&string_map(
            &deployment["spec"]["template"]["metadata"]["labels"]
        )));
        let service = manifests.one("Service", false)?;
        assert_eq!(string_map(&service["spec"]["selector"]), selector);
        let hook = hook_args(&manifests)?;
        assert_eq!(parse_selector(&hook.pod_selector)?, selector);
        assert!(
            !selects(&string_map(&job["spec"]["template"]["metadata"]["labels"])),
            "the hook would wait for its own pod"
        );

        // One image for all three binaries.
        let image = container(pod, "flux-plunger")?["image"].clone();
        assert_eq!(container(pod, "flux-plunger-drain")?["image"], image);
        assert_eq!(
            container(pod_spec(job), "flux-plunger-sweep")?["image"],
            image
        );
    }
    Ok(())
}

/// (apiGroup, resource, verb) triples a role grants, with no duplicates.
fn grants(role: &Value) -> Result<BTreeSet<(String, String, String)>> {
    let mut triples = BTreeSet::new();
    for rule in role["rules"].as_array().context("rules")? {
        let strings = |key: &str| -> Vec<String> {
            rule[key]
                .as_array()
                .into_iter()
                .flatten()
                .map(|v| v.as_str().unwrap_or_default().to_owned())
                .collect()
        };
        ensure!(
            rule.get("resourceNames").is_none() && rule.get("nonResourceURLs").is_none(),
            "unexpected rule shape: {rule}"
        );
        for group in strings("apiGroups") {
            for resource in strings("resources") {
                for verb in strings("verbs") {
                    ensure!(
                        triples.insert((group.clone(), resource.clone(), verb.clone())),
                        "{group}/{resource} {verb} granted twice"
                    );
                }
            }
        }
    }
    Ok(triples)
}

fn triples(groups: &[&str], resource: &str, verbs: &[&str]) -> Vec<(String, String, String)> {
    groups
        .iter()
        .flat_map(|g| {
            verbs
                .iter()
                .map(move |v| ((*g).to_owned(), resource.to_owned(), (*v).to_owned()))
        })
        .collect()
}

#[test]
fn the_controller_s_cluster_role_grants_exactly_what_it_needs_on_the_resources_plunger_names()
-> Result<()> {
    let manifests = Render::new(RELEASE, NAMESPACE).manifests()?;
    let expected: BTreeSet<_> = [
        triples(
            &[names::HELMRELEASE_GROUP],
            names::HELMRELEASE_PLURAL,
            &["get", "list", "watch", "patch"],
        ),
        // The history handed to helm-controller's uninstall (SPEC §5a, §5d).
        triples(
            &[names::HELMRELEASE_GROUP],
            &format!("{}/status", names::HELMRELEASE_PLURAL),
            &["patch"],
        ),
        triples(&[""], "secrets", &["get", "list", "delete"]),
        // Whether helm-controller, acting for a release, could reach its
        // storage elsewhere (plunger::storage::reach).
        triples(
            &["authorization.k8s.io"],
            "localsubjectaccessreviews",
            &["create"],
        ),
        triples(&["events.k8s.io"], "events", &["create", "patch"]),
    ]
    .concat()
    .into_iter()
    .collect();
    assert_eq!(grants(manifests.one("ClusterRole", false)?)?, expected);
    assert_eq!(
        grants(manifests.one("Role", false)?)?,
        triples(
            &["coordination.k8s.io"],
            "leases",
            &["get", "create", "update"]
        )
        .into_iter()
        .collect()
    );
    Ok(())
}

#[test]
fn the_hook_s_roles_grant_exactly_what_the_sweep_needs() -> Result<()> {
    let manifests = Render::new(RELEASE, NAMESPACE).manifests()?;
    assert_eq!(
        grants(manifests.one("ClusterRole", true)?)?,
        triples(
            &[names::HELMRELEASE_GROUP],
            names::HELMRELEASE_PLURAL,
            &["get", "list", "patch"]
        )
        .into_iter()
        .collect()
    );
    let expected: BTreeSet<_> = [
        triples(&["apps"], "deployments", &["get"]),
        triples(&["apps"], "deployments/scale", &["patch"]),
        triples(&[""], "pods", &["list"]),
        triples(&["coordination.k8s.io"], "leases", &["delete"]),
    ]
    .concat()
    .into_iter()
    .collect();
    assert_eq!(grants(manifests.one("Role", true)?)?, expected);
    Ok(())
}

#[test]
fn a_grace_period_out_of_range_is_refused_with_grace_period_error_s_reason_even_without_the_schema()
-> Result<()> {
    for g in [39_u64, 141] {
        let expected = Timings::from_grace_period(g).unwrap_err();
        assert_eq!(expected, GracePeriodError::OutOfRange(g));
        let stderr = Render::new(RELEASE, NAMESPACE)
            .set(&format!("shutdownGracePeriodSeconds={g}"))
            .arg("--skip-schema-validation")
            .error()?;
        assert!(
            stderr.contains(&expected.to_string()),
            "G={g}: expected {expected}\nhelm said: {stderr}"
        );
        let stderr = Render::new(RELEASE, NAMESPACE)
            .set(&format!("shutdownGracePeriodSeconds={g}"))
            .error()?;
        assert!(stderr.contains("'/shutdownGracePeriodSeconds'"), "{stderr}");
    }
    Ok(())
}

#[test]
fn a_grace_period_that_is_not_a_whole_number_is_refused_with_grace_period_error_s_reason()
-> Result<()> {
    // --set-json keeps 90.7 a number; --set-string keeps "abc" a string.
    for (flag, value, text) in [
        ("--set-json", "90.7", "90.7"),
        ("--set-string", "abc", "abc"),
    ] {
        let expected = Timings::parse_grace_period(text).unwrap_err();
        assert_eq!(expected, GracePeriodError::NotAnInteger(text.to_owned()));
        let stderr = Render::new(RELEASE, NAMESPACE)
            .arg(flag)
            .arg(format!("shutdownGracePeriodSeconds={value}"))
            .arg("--skip-schema-validation")
            .error()?;
        assert!(
            stderr.contains(&expected.to_string()),
            "{value}: expected {expected}\nhelm said: {stderr}"
        );
        let stderr = Render::new(RELEASE, NAMESPACE)
            .arg(flag)
            .arg(format!("shutdownGracePeriodSeconds={value}"))
            .error()?;
        assert!(stderr.contains("'/shutdownGracePeriodSeconds'"), "{stderr}");
    }
    Ok(())
}

#[test]
fn the_chart_needs_kubernetes_1_29_for_its_native_sidecar() -> Result<()> {
    let stderr = Render::new(RELEASE, NAMESPACE)
        .kube_version("1.28.15")
        .error()?;
    assert!(
        stderr.contains("chart requires kubeVersion: >=1.29.0-0"),
        "{stderr}"
    );
    // Kubernetes 1.29 serves no ValidatingAdmissionPolicy: the chart
    // installs there only with its guard turned off.
    Render::new(RELEASE, NAMESPACE)
        .kube_version("1.29.0")
        .without_admission_policies()
        .set("admissionGuard.enabled=false")
        .manifests()?;
    Ok(())
}

#[test]
fn the_schema_offers_exactly_the_log_levels_and_formats_the_binaries_accept() -> Result<()> {
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(
        chart_contract::chart_dir().join("values.schema.json"),
    )?)?;
    let enum_of = |key: &str| -> BTreeSet<String> {
        schema["properties"][key]["enum"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| v.as_str().unwrap_or_default().to_owned())
            .collect()
    };
    fn names_of<T: ValueEnum>() -> BTreeSet<String> {
        T::value_variants()
            .iter()
            .filter_map(|v| v.to_possible_value())
            .map(|p| p.get_name().to_owned())
            .collect()
    }
    assert_eq!(enum_of("logLevel"), names_of::<LogLevel>());
    assert_eq!(enum_of("logEncoding"), names_of::<LogEncoding>());
    Ok(())
}

/// The admission guard's variable `name`, whose CEL expression is a JSON
/// value (a string or a list of strings).
fn guard_variable(policy: &Value, name: &str) -> Result<Value> {
    let expression = policy["spec"]["variables"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == name)
        .and_then(|v| v["expression"].as_str())
        .with_context(|| format!("the admission guard has no variable {name}"))?;
    serde_json::from_str(expression)
        .with_context(|| format!("variable {name} is not a JSON value: {expression}"))
}

#[test]
fn the_admission_guard_allows_the_metadata_plunger_names_and_holds_the_pods_service_accounts()
-> Result<()> {
    let manifests = Render::new(RELEASE, NAMESPACE).manifests()?;
    let policy = manifests.one("ValidatingAdmissionPolicy", false)?;
    assert_eq!(
        guard_variable(policy, "ownFinalizer")?,
        Value::from(names::FENCE_FINALIZER)
    );
    assert_eq!(
        guard_variable(policy, "ownAnnotations")?,
        Value::from(names::OWN_ANNOTATIONS.to_vec())
    );
    assert_eq!(
        guard_variable(policy, "ownLabels")?,
        Value::from(names::OWN_LABELS.to_vec())
    );
    // The field managers of every HelmRelease write plunger::apply sends.
    assert_eq!(
        guard_variable(policy, "ownManagers")?,
        Value::from(vec![
            names::FIELD_MANAGER,
            names::PATCH_FIELD_MANAGER,
            names::SWEEP_FIELD_MANAGER,
            names::SHARED_FIELD_MANAGER,
        ])
    );
    // A suspension and a fence are taken only where the release is stuck
    // as plunger::release::view reads it.
    let stuck = policy["spec"]["variables"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == "oldLiveStuck")
        .and_then(|v| v["expression"].as_str())
        .context("the admission guard has no variable oldLiveStuck")?;
    for part in [
        format!("c.type == {:?}", names::READY_CONDITION),
        "c.status == \"False\"".to_owned(),
        "variables.stuckMessages.exists(m, c.message.contains(m))".to_owned(),
    ] {
        assert!(stuck.contains(&part), "{part} not in {stuck}");
    }
    assert_eq!(
        guard_variable(policy, "stuckMessages")?,
        Value::from(names::STUCK_MESSAGES.to_vec())
    );

    // Exactly the identities the chart's pods run as: the controller pod's
    // (the drain shares it) and the hook Job's.
    let condition = policy["spec"]["matchConditions"][0]["expression"]
        .as_str()
        .context("the guard has no match condition")?;
    let users: BTreeSet<String> = serde_json::from_str(
        condition
            .strip_prefix("request.userInfo.username in ")
            .with_context(|| format!("the guard matches users otherwise: {condition}"))?,
    )?;
    let user_of = |workload: &Value| {
        testkit::audit::service_account_user(
            NAMESPACE,
            pod_spec(workload)["serviceAccountName"]
                .as_str()
                .unwrap_or_default(),
        )
    };
    assert_eq!(
        users,
        BTreeSet::from([
            user_of(deployment(&manifests)?),
            user_of(hook_job(&manifests)?)
        ])
    );
    // The storage revisions it lets flux-plunger delete are those whose
    // status the recovery reclaims, of every status Helm writes.
    let helm_statuses = [
        "unknown",
        "deployed",
        "uninstalled",
        "superseded",
        "failed",
        "uninstalling",
        "pending-install",
        "pending-upgrade",
        "pending-rollback",
    ];
    let reclaimable: Vec<&str> = helm_statuses
        .into_iter()
        .filter(|s| plunger::decide::status_explains_stuck(s))
        .collect();
    let allowed: BTreeSet<String> =
        serde_json::from_value(guard_variable(policy, "reclaimableStatuses")?)?;
    assert_eq!(
        allowed,
        reclaimable
            .iter()
            .map(|s| (*s).to_owned())
            .collect::<BTreeSet<_>>()
    );

    let binding = manifests.one("ValidatingAdmissionPolicyBinding", false)?;
    assert_eq!(binding["spec"]["policyName"], policy["metadata"]["name"]);
    Ok(())
}

#[test]
fn the_admission_guard_is_rendered_where_the_cluster_serves_its_api_and_nowhere_else_unless_turned_off()
-> Result<()> {
    let guards = |render: Render| -> Result<usize> {
        let manifests = render.manifests()?;
        Ok(manifests.of_kind("ValidatingAdmissionPolicy").count()
            + manifests
                .of_kind("ValidatingAdmissionPolicyBinding")
                .count())
    };
    let render = || Render::new(RELEASE, NAMESPACE);
    assert_eq!(guards(render())?, 2);
    assert_eq!(guards(render().set("admissionGuard.enabled=false"))?, 0);
    // Where the guard would be absent, the chart does not install without
    // it unless told so, and says how to go on.
    let stderr = render().without_admission_policies().error()?;
    for says in [
        "the cluster does not serve admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy",
        "pass --api-versions admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy",
        "set admissionGuard.enabled=false",
    ] {
        assert!(stderr.contains(says), "{stderr}");
    }
    assert_eq!(
        guards(
            render()
                .without_admission_policies()
                .set("admissionGuard.enabled=false")
        )?,
        0
    );
    Ok(())
}

/// The Deployment names the install its fences' label carries, as the
/// binaries compute it from the Lease (`plunger::install::Install`), the
/// digest cut of a long name included: the chart's refusal to strand fences
/// on an upgrade looks for that value.
#[test]
fn the_install_the_chart_names_is_the_one_the_binaries_write_on_the_fence() -> Result<()> {
    let long = "a-very-long-lease-name-for-the-team-of-payments-and-billing";
    for (lease, set) in [
        (format!("{RELEASE}-flux-plunger"), None),
        (
            long.to_owned(),
            Some(format!("leaderElection.leaseName={long}")),
        ),
    ] {
        let mut render = Render::new(RELEASE, NAMESPACE);
        if let Some(set) = &set {
            render = render.set(set);
        }
        let manifests = render.manifests()?;
        let deployment = manifests.one("Deployment", false)?;
        assert_eq!(
            deployment["metadata"]["annotations"]["flux-plunger.cozystack.io/install"],
            plunger::install::Install::from_lease(NAMESPACE, &lease).fence_label_value(),
            "{lease}"
        );
    }
    Ok(())
}
