//! One version for everything a release publishes (docs/releasing.md): the
//! workspace's `[workspace.package] version`, which every crate inherits and
//! each binary's `--version` prints, is the chart's `version` and
//! `appVersion`, so `helm install ./chart` runs the image `make dist` tags
//! with it. The chart's Artifact Hub annotations follow: the image they name
//! is the one the chart runs by default, and the changes they list are
//! CHANGELOG.md's for this version.

use anyhow::{Context, Result, bail, ensure};
use chart_contract::chart_dir;
use clap::CommandFactory;
use serde_json::Value;

/// The workspace's version: this crate's, inherited like every other's.
const WORKSPACE_VERSION: &str = env!("CARGO_PKG_VERSION");

fn chart_yaml() -> Result<Value> {
    let path = chart_dir().join("Chart.yaml");
    serde_yaml::from_str(&std::fs::read_to_string(&path)?)
        .with_context(|| format!("parsing {}", path.display()))
}

fn values_yaml() -> Result<Value> {
    let path = chart_dir().join("values.yaml");
    serde_yaml::from_str(&std::fs::read_to_string(&path)?)
        .with_context(|| format!("parsing {}", path.display()))
}

/// An annotation of Chart.yaml whose value is itself YAML (Artifact Hub's
/// lists are written as a string).
fn annotation(chart: &Value, key: &str) -> Result<Value> {
    let text = chart["annotations"][key]
        .as_str()
        .with_context(|| format!("Chart.yaml has no annotation {key}"))?;
    serde_yaml::from_str(text).with_context(|| format!("the annotation {key} is not YAML"))
}

/// CHANGELOG.md's section of `version`, from its `## [version]` heading to
/// the next `## ` heading.
fn changelog_section(version: &str) -> Result<String> {
    let path = testkit::control_plane::workspace_root().join("CHANGELOG.md");
    let text = std::fs::read_to_string(&path)?;
    let heading = format!("## [{version}]");
    let start = text
        .lines()
        .position(|line| line.starts_with(&heading))
        .with_context(|| format!("CHANGELOG.md has no section {heading}"))?;
    Ok(text
        .lines()
        .skip(start + 1)
        .take_while(|line| !line.starts_with("## "))
        .collect::<Vec<_>>()
        .join("\n"))
}

/// Text with every run of white space made one space: CHANGELOG.md wraps its
/// lines, the annotation does not.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn the_chart_version_and_app_version_are_the_workspace_version() -> Result<()> {
    let chart = chart_yaml()?;
    assert_eq!(
        chart["version"], WORKSPACE_VERSION,
        "Chart.yaml's version; bump it with [workspace.package] version in Cargo.toml"
    );
    assert_eq!(
        chart["appVersion"], WORKSPACE_VERSION,
        "Chart.yaml's appVersion; bump it with [workspace.package] version in Cargo.toml"
    );
    Ok(())
}

#[test]
fn every_binary_reports_the_workspace_version() {
    for (binary, command) in [
        ("flux-plunger", flux_plunger::cli::Args::command()),
        (
            "flux-plunger-drain",
            flux_plunger_drain::cli::Args::command(),
        ),
        (
            "flux-plunger-sweep",
            flux_plunger_sweep::cli::Args::command(),
        ),
    ] {
        assert_eq!(command.get_version(), Some(WORKSPACE_VERSION), "{binary}");
    }
}

#[test]
fn the_image_artifact_hub_lists_is_the_one_the_chart_runs_by_default() -> Result<()> {
    let chart = chart_yaml()?;
    let values = values_yaml()?;
    // With no tag or digest set the chart runs repository:appVersion.
    assert_eq!(values["image"]["tag"], "", "values.yaml's image.tag");
    assert_eq!(values["image"]["digest"], "", "values.yaml's image.digest");
    let repository = values["image"]["repository"]
        .as_str()
        .context("values.yaml has no image.repository")?;
    let default_image = format!("{repository}:{WORKSPACE_VERSION}");

    let images = annotation(&chart, "artifacthub.io/images")?;
    let images = images
        .as_array()
        .context("artifacthub.io/images is not a list")?;
    assert_eq!(
        images.len(),
        1,
        "one image holds the three binaries: {images:?}"
    );
    assert_eq!(images[0]["image"], default_image.as_str());
    // The platforms make dist builds.
    assert_eq!(
        images[0]["platforms"],
        serde_json::json!(["linux/amd64", "linux/arm64"])
    );
    Ok(())
}

#[test]
fn the_changes_artifact_hub_lists_are_the_changelog_entries_of_this_version() -> Result<()> {
    let chart = chart_yaml()?;
    let section = one_line(&changelog_section(WORKSPACE_VERSION)?);
    let changes = annotation(&chart, "artifacthub.io/changes")?;
    let changes = changes
        .as_array()
        .context("artifacthub.io/changes is not a list")?;
    ensure!(!changes.is_empty(), "artifacthub.io/changes lists nothing");
    for change in changes {
        let kind = change["kind"]
            .as_str()
            .with_context(|| format!("a change without a kind: {change:?}"))?;
        // Artifact Hub's kinds are Keep a Changelog's headings, lower-cased.
        let heading = match kind {
            "added" => "### Added",
            "changed" => "### Changed",
            "deprecated" => "### Deprecated",
            "removed" => "### Removed",
            "fixed" => "### Fixed",
            "security" => "### Security",
            other => bail!("artifacthub.io/changes: unknown kind {other}"),
        };
        let description = one_line(
            change["description"]
                .as_str()
                .with_context(|| format!("a change without a description: {change:?}"))?,
        );
        // The entry is under its kind's heading: after it, before the next.
        let under_heading = section.split(heading).skip(1).any(|part| {
            part.split("### ")
                .next()
                .unwrap_or("")
                .contains(&description)
        });
        assert!(
            under_heading,
            "artifacthub.io/changes lists a {kind} change CHANGELOG.md's section {WORKSPACE_VERSION} has not under {heading}: {description}"
        );
    }
    Ok(())
}

#[test]
fn the_prerelease_and_security_flags_follow_the_version_and_the_changelog() -> Result<()> {
    let chart = chart_yaml()?;
    let section = changelog_section(WORKSPACE_VERSION)?;
    // Semantic versioning's pre-release: a hyphen after the patch number.
    let prerelease = WORKSPACE_VERSION.contains('-');
    assert_eq!(
        chart["annotations"]["artifacthub.io/prerelease"],
        prerelease.to_string(),
        "artifacthub.io/prerelease for version {WORKSPACE_VERSION}"
    );
    let security = section.lines().any(|line| line.trim() == "### Security");
    assert_eq!(
        chart["annotations"]["artifacthub.io/containsSecurityUpdates"],
        security.to_string(),
        "artifacthub.io/containsSecurityUpdates: CHANGELOG.md's section {WORKSPACE_VERSION} {} a Security heading",
        if security { "has" } else { "has no" }
    );
    Ok(())
}
