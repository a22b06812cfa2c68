//! Dev-only helpers for the chart's contract tests: render `chart/` with the
//! real helm that `make tools` builds, and read what it rendered.
//!
//! The tests themselves live in `tests/`: they hold the chart to the binaries'
//! own clap definitions, to `plunger::timings` and to `plunger::names`, and
//! install it into the local control plane.
#![forbid(unsafe_code)]

pub mod install;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;
use serde_json::Value;

/// The lowest Kubernetes version the chart accepts (Chart.yaml's
/// `kubeVersion`): native sidecars are on by default from 1.29. Every render
/// names it, so that the contract is checked for the oldest cluster the chart
/// installs on rather than for helm's default (the newest).
pub const MIN_KUBE_VERSION: &str = "1.29.0";

/// The chart directory.
pub fn chart_dir() -> PathBuf {
    testkit::control_plane::workspace_root().join("chart")
}

/// A file of `chart-tests/values/`.
pub fn values_file(name: &str) -> PathBuf {
    testkit::control_plane::workspace_root()
        .join("chart-tests")
        .join("values")
        .join(name)
}

pub use testkit::control_plane::helm;

/// One `helm template` invocation of the chart.
#[derive(Debug, Clone)]
pub struct Render {
    release: String,
    namespace: String,
    kube_version: String,
    serving_admission_policies: bool,
    args: Vec<String>,
}

impl Render {
    pub fn new(release: &str, namespace: &str) -> Self {
        Self {
            release: release.to_owned(),
            namespace: namespace.to_owned(),
            kube_version: MIN_KUBE_VERSION.to_owned(),
            serving_admission_policies: true,
            args: Vec::new(),
        }
    }

    /// Any further argument of `helm template`, e.g. `--set`, `--set-json`,
    /// `--skip-schema-validation`.
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// `--set key=value`.
    pub fn set(self, key_value: &str) -> Self {
        self.arg("--set").arg(key_value)
    }

    /// `-f chart-tests/values/<name>`.
    pub fn values(self, name: &str) -> Self {
        let path = values_file(name);
        self.arg("-f").arg(path.display().to_string())
    }

    /// Renders as for a cluster that does not serve
    /// ValidatingAdmissionPolicy (Kubernetes 1.29, or `helm template`
    /// without `--api-versions`). By default a render is for a cluster that
    /// serves it, as helm's discovery of the local control plane says, and
    /// the chart refuses to render with its guard on anywhere else.
    pub fn without_admission_policies(mut self) -> Self {
        self.serving_admission_policies = false;
        self
    }

    /// Renders as if for this Kubernetes version.
    pub fn kube_version(mut self, version: &str) -> Self {
        self.kube_version = version.to_owned();
        self
    }

    fn command(&self) -> Result<Command> {
        let mut cmd = helm()?;
        cmd.arg("template")
            .arg(&self.release)
            .arg(chart_dir())
            .arg("--namespace")
            .arg(&self.namespace)
            .arg("--kube-version")
            .arg(&self.kube_version);
        if self.serving_admission_policies {
            cmd.arg("--api-versions")
                .arg(testkit::guard::ADMISSION_POLICY_API);
        }
        cmd.args(&self.args);
        Ok(cmd)
    }

    /// The rendered YAML stream; an error with helm's stderr if it failed.
    pub fn yaml(&self) -> Result<String> {
        let output = self.command()?.output().context("running helm template")?;
        if !output.status.success() {
            bail!(
                "helm template {:?} failed: {}",
                self.args,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(String::from_utf8(output.stdout)?)
    }

    /// The rendered objects, hooks included.
    pub fn manifests(&self) -> Result<Manifests> {
        Manifests::parse(&self.yaml()?)
    }

    /// helm's stderr, for a render that must fail; an error if it succeeded.
    pub fn error(&self) -> Result<String> {
        let output = self.command()?.output().context("running helm template")?;
        if output.status.success() {
            bail!(
                "helm template {:?} succeeded but should have failed",
                self.args
            );
        }
        Ok(String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

/// The objects of one render, as JSON values.
#[derive(Debug, Clone)]
pub struct Manifests(pub Vec<Value>);

impl Manifests {
    pub fn parse(yaml: &str) -> Result<Self> {
        let mut objects = Vec::new();
        for document in serde_yaml::Deserializer::from_str(yaml) {
            let value = Value::deserialize(document)?;
            if !value.is_null() {
                objects.push(value);
            }
        }
        Ok(Self(objects))
    }

    /// Every object of `kind`.
    pub fn of_kind(&self, kind: &str) -> impl Iterator<Item = &Value> + '_ {
        let kind = kind.to_owned();
        self.0.iter().filter(move |o| o["kind"] == kind.as_str())
    }

    /// The one object of `kind` that is (`hook == true`) or is not a Helm
    /// hook; an error unless there is exactly one.
    pub fn one(&self, kind: &str, hook: bool) -> Result<&Value> {
        let found: Vec<&Value> = self.of_kind(kind).filter(|o| is_hook(o) == hook).collect();
        match found.as_slice() {
            [one] => Ok(one),
            _ => Err(anyhow!(
                "expected one {kind} (hook: {hook}), found {}",
                found.len()
            )),
        }
    }
}

/// Every permission the rendered ClusterRoles and Roles that are
/// (`hook == true`) or are not Helm hooks grant: one per API group, resource
/// and verb.
pub fn granted_permissions(
    manifests: &Manifests,
    hook: bool,
) -> std::collections::BTreeSet<testkit::audit::Permission> {
    let strings = |value: &Value| -> Vec<String> {
        value
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect()
    };
    let mut granted = std::collections::BTreeSet::new();
    for role in ["ClusterRole", "Role"]
        .into_iter()
        .flat_map(|kind| manifests.of_kind(kind))
        .filter(|role| is_hook(role) == hook)
    {
        for rule in role["rules"].as_array().into_iter().flatten() {
            for group in strings(&rule["apiGroups"]) {
                for resource in strings(&rule["resources"]) {
                    for verb in strings(&rule["verbs"]) {
                        granted.insert(testkit::audit::Permission {
                            group: group.clone(),
                            resource: resource.clone(),
                            verb,
                        });
                    }
                }
            }
        }
    }
    granted
}

/// Fails unless, since `offset` of the audit log ([`testkit::audit::mark`]),
/// the apiserver refused `user` nothing and `user` used every permission the
/// rendered roles (hook or not) grant, and no other. RBAC only adds up and
/// no two of the chart's rules grant the same permission, so dropping any
/// rule (or verb) would refuse a request the caller's scenario needs: each
/// rule is needed, and none is granted unused.
pub fn check_uses_exactly_what_is_granted(
    user: &str,
    manifests: &Manifests,
    hook: bool,
    offset: u64,
) -> Result<()> {
    use testkit::audit;
    let requests = audit::requests_by_since(user, offset)?;
    let refused: Vec<String> = audit::refused(&requests)
        .iter()
        .map(|r| format!("{} in {:?}", r.permission, r.namespace))
        .collect();
    if !refused.is_empty() {
        bail!("the apiserver refused {user}: {refused:?}");
    }
    let used = audit::allowed(&requests);
    let granted = granted_permissions(manifests, hook);
    let show = |set: Vec<&testkit::audit::Permission>| -> Vec<String> {
        set.into_iter().map(ToString::to_string).collect()
    };
    let unused = show(granted.difference(&used).collect());
    let ungranted = show(used.difference(&granted).collect());
    if !unused.is_empty() || !ungranted.is_empty() {
        bail!("{user}: granted but never used {unused:?}; used but not granted {ungranted:?}");
    }
    Ok(())
}

/// Whether Helm treats the object as a hook.
pub fn is_hook(object: &Value) -> bool {
    object["metadata"]["annotations"]["helm.sh/hook"].is_string()
}

/// `metadata.name`.
pub fn name(object: &Value) -> &str {
    object["metadata"]["name"].as_str().unwrap_or_default()
}

/// A string map (labels, matchLabels) as a sorted map.
pub fn string_map(value: &Value) -> BTreeMap<String, String> {
    value
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
        .collect()
}

/// Parses a `k=v,k=v` label selector, the form the hook's `--pod-selector`
/// takes.
pub fn parse_selector(selector: &str) -> Result<BTreeMap<String, String>> {
    selector
        .split(',')
        .map(|pair| {
            pair.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .ok_or_else(|| anyhow!("{pair:?} in {selector:?} is not k=v"))
        })
        .collect()
}

/// A container's (or init container's) `command` followed by its `args`: the
/// argv the binary sees.
pub fn argv(container: &Value) -> Vec<String> {
    ["command", "args"]
        .iter()
        .flat_map(|key| container[*key].as_array().cloned().unwrap_or_default())
        .map(|v| v.as_str().unwrap_or_default().to_owned())
        .collect()
}

/// The container named `name` among `containers` and `initContainers` of a
/// pod spec.
pub fn container<'a>(pod_spec: &'a Value, name: &str) -> Result<&'a Value> {
    ["containers", "initContainers"]
        .iter()
        .flat_map(|key| pod_spec[*key].as_array().into_iter().flatten())
        .find(|c| c["name"] == name)
        .ok_or_else(|| anyhow!("no container named {name}"))
}

/// The argv a container's binary would see in a pod, with each environment
/// variable the chart sets turned into the flag that reads it: clap reads
/// these variables from the process environment, which a test cannot set
/// safely, so the flag stands in for it. A variable that no flag of the
/// binary reads is an error, since the chart would be setting it for nothing.
///
/// `field` resolves a downward-API `fieldPath` to the value the kubelet
/// would give.
pub fn pod_argv(
    command: &clap::Command,
    container: &Value,
    field: impl Fn(&str) -> Option<String>,
) -> Result<Vec<String>> {
    let mut argv = argv(container);
    // A subcommand, if the argv names one: its flags go after it, the
    // binary's own flags before it.
    let subcommand = command
        .get_subcommands()
        .find(|s| argv.iter().any(|a| a == s.get_name()));
    let mut top_level = Vec::new();
    let mut trailing = Vec::new();
    for env in container["env"].as_array().into_iter().flatten() {
        let var = env["name"].as_str().context("env entry without a name")?;
        let value = match env["value"].as_str() {
            Some(value) => value.to_owned(),
            None => {
                let path = env["valueFrom"]["fieldRef"]["fieldPath"]
                    .as_str()
                    .with_context(|| format!("{var}: neither a value nor a fieldRef"))?;
                field(path).with_context(|| format!("{var}: unknown fieldPath {path}"))?
            }
        };
        let reads = |c: &clap::Command| {
            c.get_arguments()
                .find(|a| a.get_env().is_some_and(|e| e == var))
                .and_then(|a| a.get_long())
                .map(|long| format!("--{long}={value}"))
        };
        // The command that runs reads the variable: the subcommand when the
        // argv names one (clap does not apply the parent's env to it).
        if let Some(flag) = subcommand.and_then(reads) {
            trailing.push(flag);
        } else if let Some(flag) = reads(command) {
            top_level.push(flag);
        } else {
            bail!(
                "the chart sets {var} for {}, but no flag of it reads {var}",
                command.get_name()
            );
        }
    }
    let program = if argv.is_empty() {
        String::new()
    } else {
        argv.remove(0)
    };
    Ok(std::iter::once(program)
        .chain(top_level)
        .chain(argv)
        .chain(trailing)
        .collect())
}
