//! The test world's OCI registry (`testkit::registry`): HTTPS with a
//! certificate from the control plane's CA, and what a chart's and an
//! image's clients do with it — push by tag, pull by digest.

use anyhow::{Context, Result, ensure};
use testkit::chart::{CHART_NAME, CHART_VERSION, demo_chart};
use testkit::control_plane::helm;
use testkit::registry::registry;

#[test]
fn a_pushed_chart_is_pulled_back_by_its_manifest_digest_byte_for_byte() -> Result<()> {
    let registry = registry();
    let chart = demo_chart()?;
    let pushed = registry.push_chart("pull-by-digest", CHART_NAME, CHART_VERSION, &chart)?;

    // By digest, as containerd pulls an image a pod names by digest: the
    // manifest by its digest, then the layers it names.
    let into = tempfile::tempdir()?;
    let output = helm()?
        .arg("pull")
        .arg(format!("{}@{}", pushed.url, pushed.digest))
        .arg("--ca-file")
        .arg(&registry.ca_cert)
        .arg("--destination")
        .arg(into.path())
        .output()?;
    ensure!(
        output.status.success(),
        "helm pull failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let pulled = std::fs::read_dir(into.path())?
        .next()
        .context("helm pull wrote nothing")??
        .path();
    assert_eq!(std::fs::read(&pulled)?, chart.bytes);
    Ok(())
}
