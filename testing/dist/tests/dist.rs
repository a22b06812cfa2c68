//! `make dist` run for real, as a maintainer runs it for a release
//! (docs/releasing.md), into the test world's OCI registry: with a key pair
//! made for this run, the registry trusted by its CA. Then what it pushed is
//! checked from the registry as a user checks a release: `cosign verify`
//! with the release's public key passes on the image and the chart and fails
//! with another key; the image is an index of a linux/amd64 and a linux/arm64
//! image whose binaries are static, of their platform's machine, and carry
//! their crate graph; the SBOM attestation verifies and lists every crate
//! they carry; the chart pulled back is the workspace's version and runs the
//! pushed image by default; and Flux's real source-controller, given the
//! release's public key in an `OCIRepository`'s `spec.verify`, serves the
//! chart, and given another key refuses it.
//!
//! `make dist` runs once per test process, on first use; `make test-dist`
//! runs this file.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use base64::Engine;
use dist::{EM_AARCH64, EM_X86_64, Elf, Layout, audit_data, crates, layer_files, str_field};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DynamicObject, PostParams};
use serde_json::{Value, json};
use testkit::control_plane::{helm, out_dir, tool, workspace_root};
use testkit::registry::registry;
use testkit::source_controller::{HELM_CHART_LAYER, ocirepository_resource, source_controller};
use testkit::{TestNamespace, control_plane};

/// The workspace's version, which every crate inherits: what make dist
/// releases.
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The key pairs' password (cosign encrypts a private key it writes).
const PASSWORD: &str = "a throwaway key of the dist test";

const BINARIES: [&str; 3] = ["flux-plunger", "flux-plunger-drain", "flux-plunger-sweep"];

/// What one `make dist` published, and how to reach it.
struct Release {
    /// Everything of this run: the keys, make dist's output, cosign's state.
    dir: PathBuf,
    /// The registry's CA.
    ca: PathBuf,
    /// `HOST/flux-plunger/flux-plunger`: the image's repository.
    image: String,
    /// `HOST/flux-plunger/charts/flux-plunger`: the chart's repository.
    chart: String,
    /// The digests make dist reports it pushed.
    image_digest: String,
    chart_digest: String,
}

static RELEASE: OnceLock<Result<Release, String>> = OnceLock::new();

fn release() -> &'static Release {
    match RELEASE.get_or_init(|| Release::publish().map_err(|e| format!("{e:#}"))) {
        Ok(release) => release,
        Err(e) => panic!("make dist did not publish: {e}"),
    }
}

impl Release {
    fn publish() -> Result<Self> {
        let registry = registry();
        let dir = out_dir().join("dist-test");
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        let keys = dir.join("keys");
        std::fs::create_dir_all(&keys)?;
        for pair in ["release", "other"] {
            succeeded(
                cosign(&dir)?.current_dir(&keys).args([
                    "generate-key-pair",
                    "--output-key-prefix",
                    pair,
                ]),
                "cosign generate-key-pair",
            )?;
        }

        // Where a release names ghcr.io/flux-plunger.
        let namespace = format!("{}/flux-plunger", registry.host);
        let published = dir.join("published");
        eprintln!("dist test: make dist DIST_REGISTRY={namespace}");
        let mut make = Command::new("make");
        // What `cargo test` tells this test about its own package
        // (CARGO_PKG_NAME=dist, CARGO_MANIFEST_DIR, …) must not reach make
        // dist's cargo builds: build scripts that watch those variables
        // (ring's) would run again, and every crate above them be rebuilt,
        // here and in the next make image.
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy();
            if ["CARGO_PKG_", "CARGO_MANIFEST_", "CARGO_BIN_"]
                .iter()
                .any(|prefix| name.starts_with(prefix))
                || [
                    "CARGO_CRATE_NAME",
                    "CARGO_PRIMARY_PACKAGE",
                    "CARGO_TARGET_TMPDIR",
                    "CARGO_RUSTC_CURRENT_DIR",
                    "OUT_DIR",
                ]
                .contains(&&*name)
            {
                make.env_remove(&*name);
            }
        }
        let status = make
            .arg("-C")
            .arg(workspace_root())
            .arg("--no-print-directory")
            .arg("dist")
            .arg(format!("DIST_REGISTRY={namespace}"))
            .arg(format!(
                "DIST_COSIGN_KEY={}",
                keys.join("release.key").display()
            ))
            .arg(format!(
                "DIST_COSIGN_PUB={}",
                keys.join("release.pub").display()
            ))
            .arg(format!("DIST_CA_FILE={}", registry.ca_cert.display()))
            .arg(format!("DIST_DIR={}", published.display()))
            .env("COSIGN_PASSWORD", PASSWORD)
            // A make of its own, not a job of the make that runs this test.
            .env_remove("MAKEFLAGS")
            .env_remove("MFLAGS")
            .env_remove("MAKELEVEL")
            .stdin(Stdio::null())
            .status()
            .context("running make dist")?;
        ensure!(status.success(), "make dist failed: {status}");

        let report = std::fs::read_to_string(published.join("published"))?;
        let field = |key: &str| {
            report
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .with_context(|| format!("make dist reported no {key}: {report}"))
        };
        let image = format!("{namespace}/flux-plunger");
        let chart = format!("{namespace}/charts/flux-plunger");
        let image_digest = field(&format!("image={image}:{VERSION}@"))?.to_owned();
        let chart_digest = field(&format!("chart=oci://{chart}:{VERSION}@"))?.to_owned();
        Ok(Self {
            dir,
            ca: registry.ca_cert.clone(),
            image,
            chart,
            image_digest,
            chart_digest,
        })
    }

    fn key(&self, pair: &str) -> PathBuf {
        self.dir.join("keys").join(format!("{pair}.pub"))
    }

    /// `cosign verify` (or `verify-attestation`) of `reference` with the
    /// public key of `pair`, the registry trusted by its CA.
    fn verify(&self, command: &str, pair: &str, reference: &str) -> Result<Output> {
        let mut cmd = cosign(&self.dir)?;
        cmd.arg(command)
            .arg("--key")
            .arg(self.key(pair))
            // No transparency log holds a release's signatures: the key alone
            // vouches for them (docs/releasing.md).
            .arg("--insecure-ignore-tlog")
            .arg("--registry-cacert")
            .arg(&self.ca);
        if command == "verify-attestation" {
            cmd.args(["--type", "cyclonedx"]);
        }
        Ok(cmd.arg(reference).output()?)
    }

    /// The pushed index saved by `cosign save` from the registry: an OCI
    /// layout holding the index, both images, their configs and layers.
    fn saved_index(&self) -> Result<Layout> {
        static SAVED: OnceLock<Result<PathBuf, String>> = OnceLock::new();
        let saved = SAVED.get_or_init(|| {
            let dir = self.dir.join("saved");
            succeeded(
                cosign(&self.dir)
                    .map_err(|e| format!("{e:#}"))?
                    .args(["save", "--dir"])
                    .arg(&dir)
                    .arg("--registry-cacert")
                    .arg(&self.ca)
                    .arg(format!("{}:{VERSION}", self.image)),
                "cosign save",
            )
            .map_err(|e| format!("{e:#}"))?;
            Ok(dir)
        });
        match saved {
            Ok(dir) => Layout::open(dir),
            Err(e) => bail!("{e}"),
        }
    }

    /// The index's images: (platform, manifest, config), each read from the
    /// saved layout by the digest its parent names.
    fn platform_images(&self) -> Result<Vec<(String, Value, Value)>> {
        let layout = self.saved_index()?;
        let top = layout.index()?;
        let index_digest = str_field(&top, "/manifests/0/digest")?;
        ensure!(
            index_digest == self.image_digest,
            "the tag {VERSION} names {index_digest}, make dist pushed {}",
            self.image_digest
        );
        let index = layout.json(index_digest)?;
        let mut images = Vec::new();
        for entry in index["manifests"]
            .as_array()
            .context("an index without manifests")?
        {
            let platform = format!(
                "{}/{}",
                str_field(entry, "/platform/os")?,
                str_field(entry, "/platform/architecture")?
            );
            let manifest = layout.json(str_field(entry, "/digest")?)?;
            let config = layout.json(str_field(&manifest, "/config/digest")?)?;
            images.push((platform, manifest, config));
        }
        Ok(images)
    }
}

/// `_out/bin/cosign`, its TUF cache and registry credentials under `dir`
/// rather than in `$HOME` (with a key and no transparency log it reads
/// neither), the key pairs' password set.
fn cosign(dir: &Path) -> Result<Command> {
    let docker_config = dir.join("docker-config");
    std::fs::create_dir_all(&docker_config)?;
    std::fs::write(docker_config.join("config.json"), "{}")?;
    let mut cmd = Command::new(tool("cosign")?);
    cmd.env("TUF_ROOT", dir.join("tuf"))
        .env("DOCKER_CONFIG", docker_config)
        .env("COSIGN_PASSWORD", PASSWORD)
        .stdin(Stdio::null());
    Ok(cmd)
}

fn succeeded(cmd: &mut Command, what: &str) -> Result<Output> {
    let output = cmd.output().with_context(|| format!("running {what}"))?;
    if !output.status.success() {
        bail!(
            "{what} failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(output)
}

fn said(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The manifest digests the payloads of a passing `cosign verify` vouch for.
fn verified_digests(output: &Output) -> Result<BTreeSet<String>> {
    let payloads: Value = serde_json::from_slice(&output.stdout)
        .with_context(|| format!("cosign verify printed no JSON: {}", said(output)))?;
    payloads
        .as_array()
        .context("cosign verify printed no list of payloads")?
        .iter()
        .map(|p| Ok(str_field(p, "/critical/image/docker-manifest-digest")?.to_owned()))
        .collect()
}

#[test]
fn the_image_and_the_chart_verify_with_the_release_key_at_the_digests_pushed() -> Result<()> {
    let release = release();
    for (reference, digest) in [
        (
            format!("{}:{VERSION}", release.image),
            &release.image_digest,
        ),
        (
            format!("{}:{VERSION}", release.chart),
            &release.chart_digest,
        ),
    ] {
        let output = release.verify("verify", "release", &reference)?;
        assert!(
            output.status.success(),
            "cosign verify {reference}: {}",
            said(&output)
        );
        assert_eq!(
            verified_digests(&output)?,
            BTreeSet::from([digest.clone()]),
            "what the signatures of {reference} vouch for"
        );
    }
    Ok(())
}

#[test]
fn each_platform_image_is_signed_too() -> Result<()> {
    let release = release();
    let layout = release.saved_index()?;
    let index = layout.json(&release.image_digest)?;
    for entry in index["manifests"]
        .as_array()
        .context("an index without manifests")?
    {
        let digest = str_field(entry, "/digest")?;
        let reference = format!("{}@{digest}", release.image);
        let output = release.verify("verify", "release", &reference)?;
        assert!(
            output.status.success(),
            "cosign verify {reference}: {}",
            said(&output)
        );
    }
    Ok(())
}

#[test]
fn a_key_that_did_not_sign_the_release_verifies_nothing_of_it() -> Result<()> {
    let release = release();
    let image = format!("{}:{VERSION}", release.image);
    let chart = format!("{}:{VERSION}", release.chart);
    for (command, reference) in [
        ("verify", &image),
        ("verify", &chart),
        ("verify-attestation", &image),
    ] {
        let output = release.verify(command, "other", reference)?;
        let said = said(&output);
        assert!(
            !output.status.success(),
            "cosign {command} {reference} passed with another key"
        );
        // Refused for its signature, not for want of one or of the registry.
        assert!(
            said.contains("failed to verify signature"),
            "cosign {command} {reference} with another key: {said}"
        );
    }
    Ok(())
}

#[test]
fn the_image_is_an_index_of_a_linux_amd64_and_a_linux_arm64_image() -> Result<()> {
    let images = release().platform_images()?;
    let platforms: BTreeSet<&str> = images.iter().map(|(p, _, _)| p.as_str()).collect();
    assert_eq!(platforms, BTreeSet::from(["linux/amd64", "linux/arm64"]));
    assert_eq!(images.len(), 2, "the index lists {platforms:?}");
    for (platform, _, config) in &images {
        let configured = format!(
            "{}/{}",
            str_field(config, "/os")?,
            str_field(config, "/architecture")?
        );
        assert_eq!(&configured, platform, "the {platform} image's config");
        assert_eq!(
            config["config"]["User"], "65532:65532",
            "the {platform} image's user"
        );
        assert_eq!(
            config["config"]["Labels"]["org.opencontainers.image.version"], VERSION,
            "the {platform} image's version label"
        );
    }
    Ok(())
}

/// The three binaries of a platform's image, from its layers.
fn binaries_of(layout: &Layout, manifest: &Value) -> Result<Vec<(String, Vec<u8>)>> {
    let mut found = Vec::new();
    for layer in manifest["layers"]
        .as_array()
        .context("a manifest without layers")?
    {
        for (path, bytes) in layer_files(&layout.blob(str_field(layer, "/digest")?)?)? {
            if let Some(name) = path.strip_prefix("usr/local/bin/") {
                found.push((name.to_owned(), bytes));
            }
        }
    }
    found.sort();
    let names: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).collect();
    ensure!(names == BINARIES, "usr/local/bin holds {names:?}");
    Ok(found)
}

#[test]
fn each_image_holds_static_binaries_of_its_machine_that_carry_their_crate_graph() -> Result<()> {
    let release = release();
    let layout = release.saved_index()?;
    for (platform, manifest, _) in release.platform_images()? {
        let machine = match platform.as_str() {
            "linux/amd64" => EM_X86_64,
            "linux/arm64" => EM_AARCH64,
            other => bail!("an image for {other}"),
        };
        for (binary, bytes) in binaries_of(&layout, &manifest)? {
            let elf = Elf::parse(&bytes).with_context(|| format!("{platform} {binary}"))?;
            assert_eq!(elf.machine()?, machine, "{platform} {binary}'s machine");
            assert!(elf.is_static()?, "{platform} {binary} asks for a loader");
            let audit = audit_data(&elf).with_context(|| format!("{platform} {binary}"))?;
            let packages = audit["packages"].as_array().context("no packages")?;
            let root: Vec<&Value> = packages.iter().filter(|p| p["root"] == true).collect();
            assert_eq!(root.len(), 1, "{platform} {binary}: one root crate");
            assert_eq!(
                root[0]["name"],
                binary.as_str(),
                "{platform} {binary}'s root crate"
            );
            assert_eq!(root[0]["version"], VERSION, "{platform} {binary}'s version");
            let names: BTreeSet<(String, String)> = crates(&audit)?.into_iter().collect();
            assert!(
                names.contains(&("plunger".to_owned(), VERSION.to_owned())),
                "{platform} {binary} does not list plunger {VERSION}"
            );
            assert!(
                names.iter().any(|(name, _)| name == "kube"),
                "{platform} {binary} does not list kube"
            );
        }
    }
    Ok(())
}

#[test]
fn the_sbom_attestation_verifies_and_lists_every_crate_the_binaries_carry() -> Result<()> {
    let release = release();
    let image = format!("{}:{VERSION}", release.image);
    let output = release.verify("verify-attestation", "release", &image)?;
    assert!(
        output.status.success(),
        "cosign verify-attestation {image}: {}",
        said(&output)
    );
    let stdout = String::from_utf8(output.stdout)?;
    let envelopes: Vec<Value> = stdout
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .with_context(|| format!("cosign verify-attestation printed: {stdout}"))?;
    assert_eq!(envelopes.len(), 1, "one SBOM attested: {stdout}");
    let statement: Value = serde_json::from_slice(
        &base64::engine::general_purpose::STANDARD.decode(str_field(&envelopes[0], "/payload")?)?,
    )?;
    assert_eq!(statement["predicateType"], "https://cyclonedx.org/bom");
    assert_eq!(
        format!(
            "sha256:{}",
            str_field(&statement, "/subject/0/digest/sha256")?
        ),
        release.image_digest,
        "the SBOM's subject"
    );
    let sbom = &statement["predicate"];
    assert_eq!(sbom["bomFormat"], "CycloneDX");
    assert_eq!(sbom["metadata"]["component"]["version"], VERSION);
    let components = sbom["components"]
        .as_array()
        .context("an SBOM without components")?;
    let listed: BTreeSet<(String, String)> = components
        .iter()
        .map(|c| {
            Ok((
                str_field(c, "/name")?.to_owned(),
                str_field(c, "/version")?.to_owned(),
            ))
        })
        .collect::<Result<_>>()?;
    let applications: BTreeSet<&str> = components
        .iter()
        .filter(|c| c["type"] == "application")
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(
        applications,
        BTreeSet::from(BINARIES),
        "the SBOM's applications"
    );

    // Every crate of every binary of both images, as the binaries carry them.
    let layout = release.saved_index()?;
    let mut carried = BTreeSet::new();
    for (_, manifest, _) in release.platform_images()? {
        for (_, bytes) in binaries_of(&layout, &manifest)? {
            carried.extend(crates(&audit_data(&Elf::parse(&bytes)?)?)?);
        }
    }
    let missing: Vec<_> = carried.difference(&listed).collect();
    assert!(
        missing.is_empty(),
        "crates the binaries carry and the SBOM omits: {missing:?}"
    );
    let extra: Vec<_> = listed.difference(&carried).collect();
    assert!(
        extra.is_empty(),
        "crates the SBOM lists and no binary carries: {extra:?}"
    );
    // A scanner matches crates.io crates by purl.
    let kube = components
        .iter()
        .find(|c| c["name"] == "kube")
        .context("the SBOM does not list kube")?;
    assert_eq!(
        kube["purl"],
        format!("pkg:cargo/kube@{}", str_field(kube, "/version")?),
        "kube's purl"
    );
    Ok(())
}

#[test]
fn the_chart_pulled_back_is_the_workspace_version_and_runs_the_pushed_image() -> Result<()> {
    let release = release();
    let dir = tempfile::tempdir()?;
    let output = succeeded(
        helm()?
            .args(["pull", &format!("oci://{}", release.chart)])
            .args(["--version", VERSION])
            .arg("--ca-file")
            .arg(&release.ca)
            .arg("--destination")
            .arg(dir.path()),
        "helm pull",
    )?;
    assert!(
        said(&output).contains(&format!("Digest: {}", release.chart_digest)),
        "helm pull: {}",
        said(&output)
    );
    let package = dir.path().join(format!("flux-plunger-{VERSION}.tgz"));

    let chart: Value = serde_yaml::from_slice(
        &succeeded(
            helm()?.arg("show").arg("chart").arg(&package),
            "helm show chart",
        )?
        .stdout,
    )?;
    assert_eq!(chart["version"], VERSION, "the pulled chart's version");
    assert_eq!(
        chart["appVersion"], VERSION,
        "the pulled chart's appVersion"
    );

    // With only the repository set, as a user installing from a mirror of
    // the release does, the chart runs the tag make dist pushed and signed.
    let rendered = succeeded(
        helm()?
            .arg("template")
            .arg("flux-plunger")
            .arg(&package)
            .args(["--namespace", "flux-system"])
            .args(["--api-versions", testkit::guard::ADMISSION_POLICY_API])
            .arg("--set")
            .arg(format!("image.repository={}", release.image)),
        "helm template",
    )?;
    let mut images = BTreeSet::new();
    for document in serde_yaml::Deserializer::from_slice(&rendered.stdout) {
        let object: Value = serde::Deserialize::deserialize(document)?;
        let spec = &object["spec"]["template"]["spec"];
        for list in ["containers", "initContainers"] {
            for container in spec[list].as_array().into_iter().flatten() {
                images.insert(str_field(container, "/image")?.to_owned());
            }
        }
    }
    assert_eq!(
        images,
        BTreeSet::from([format!("{}:{VERSION}", release.image)]),
        "the images the chart's pods run"
    );
    Ok(())
}

/// How long source-controller may take to pull and verify the chart.
const VERIFY_TIMEOUT: Duration = Duration::from_secs(120);

/// A Flux user verifies the chart as docs/releasing.md says, by
/// `spec.verify` on the README's `OCIRepository`: the real source-controller
/// accepts what make dist signed with the release key, and refuses it with
/// another.
#[tokio::test]
async fn flux_verifies_the_chart_with_the_release_key_and_refuses_it_with_another() -> Result<()> {
    let release = release();
    source_controller();
    let client = control_plane().client().await?;
    let ns = TestNamespace::create(&client, "dist-verify").await?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns.name);
    let sources: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns.name, &ocirepository_resource());
    for pair in ["release", "other"] {
        let key = std::fs::read_to_string(release.key(pair))?;
        let secret = json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": format!("cosign-{pair}")},
            "stringData": {"cosign.pub": key},
        });
        secrets
            .create(&PostParams::default(), &serde_json::from_value(secret)?)
            .await?;
        let source = json!({
            "apiVersion": "source.toolkit.fluxcd.io/v1",
            "kind": "OCIRepository",
            "metadata": {"name": pair},
            "spec": {
                "interval": "1h",
                "url": format!("oci://{}", release.chart),
                "ref": {"tag": VERSION},
                "layerSelector": {"mediaType": HELM_CHART_LAYER, "operation": "copy"},
                "verify": {"provider": "cosign", "secretRef": {"name": format!("cosign-{pair}")}},
            },
        });
        sources
            .create(&PostParams::default(), &serde_json::from_value(source)?)
            .await?;
    }

    let verified = verification_of(&sources, "release").await?;
    assert_eq!(
        verified.condition["status"], "True",
        "SourceVerified with the release key: {:#}",
        verified.status
    );
    assert_eq!(
        verified.status["artifact"]["revision"],
        format!("{VERSION}@{}", release.chart_digest),
        "the artifact source-controller serves: {:#}",
        verified.status
    );
    assert!(
        is_true(&verified.status, "Ready"),
        "Ready with the release key: {:#}",
        verified.status
    );

    let refused = verification_of(&sources, "other").await?;
    assert_eq!(
        (&refused.condition["status"], &refused.condition["reason"]),
        (&json!("False"), &json!("VerificationError")),
        "SourceVerified with another key: {:#}",
        refused.status
    );
    assert!(
        refused.status["artifact"].is_null() && !is_true(&refused.status, "Ready"),
        "a chart whose signature did not verify is served: {:#}",
        refused.status
    );
    Ok(())
}

/// An `OCIRepository`'s status once source-controller has decided on its
/// signature, and the `SourceVerified` condition it wrote for the generation
/// it read.
struct Verification {
    status: Value,
    condition: Value,
}

/// Waits until source-controller has written `SourceVerified` for the current
/// generation of OCIRepository `name`: the end of its verification, passed or
/// refused. On timeout, the error carries source-controller's log.
async fn verification_of(sources: &Api<DynamicObject>, name: &str) -> Result<Verification> {
    let deadline = Instant::now() + VERIFY_TIMEOUT;
    loop {
        let source = sources.get(name).await?;
        let generation = source.metadata.generation;
        let status = source.data["status"].clone();
        let condition = status["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| {
                c["type"] == "SourceVerified" && c["observedGeneration"].as_i64() == generation
            })
            .cloned();
        if let Some(condition) = condition {
            return Ok(Verification { status, condition });
        }
        if Instant::now() > deadline {
            bail!(
                "source-controller did not verify OCIRepository {name} in {}s; its status: {status:#}\n\
                 source-controller log:\n{}",
                VERIFY_TIMEOUT.as_secs(),
                source_controller().controller.log_tail(40)
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn is_true(status: &Value, condition: &str) -> bool {
    status["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == condition && c["status"] == "True")
}
