//! A tiny Helm chart, packaged the way `helm package` does (a gzipped tar
//! whose entries sit under a directory named after the chart), built in the
//! test so no chart file lives in the repository.
//!
//! Its only object is a ConfigMap: no kubelet runs on the local control plane,
//! so anything that needs a pod would never become ready.

use anyhow::Result;
use sha2::{Digest, Sha256};

/// Name of the demo chart.
pub const CHART_NAME: &str = "demo";
/// Version of the demo chart.
pub const CHART_VERSION: &str = "1.0.0";

/// The ConfigMap the demo chart installs for `release`.
pub fn configmap_name(release: &str) -> String {
    format!("{release}-demo")
}

/// A packaged chart and its digest.
#[derive(Clone, Debug)]
pub struct ChartArchive {
    pub bytes: Vec<u8>,
    /// `sha256:<hex>`, the form a Flux source artifact's `digest` takes.
    pub digest: String,
}

impl ChartArchive {
    /// A chart packaged elsewhere (`helm package`), with its digest.
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        let digest = format!("sha256:{:x}", Sha256::digest(&bytes));
        Self { bytes, digest }
    }
}

const CHART_YAML: &str = "apiVersion: v2
name: demo
description: One ConfigMap, for tests against a control plane without a kubelet.
type: application
version: 1.0.0
appVersion: \"1.0.0\"
";

const VALUES_YAML: &str = "greeting: hello
";

const CONFIGMAP_YAML: &str = "apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ .Release.Name }}-demo
  namespace: {{ .Release.Namespace }}
data:
  greeting: {{ .Values.greeting | quote }}
";

/// The demo chart as a `.tgz`. Byte-for-byte the same on every call (fixed
/// modes and times), so its digest is stable.
pub fn demo_chart() -> Result<ChartArchive> {
    let mut tar = tar::Builder::new(Vec::new());
    for (path, text) in [
        ("demo/Chart.yaml", CHART_YAML),
        ("demo/values.yaml", VALUES_YAML),
        ("demo/templates/configmap.yaml", CONFIGMAP_YAML),
    ] {
        let mut header = tar::Header::new_gnu();
        header.set_size(text.len() as u64);
        header.set_mode(0o644);
        header.set_mtime(1_767_225_600);
        header.set_entry_type(tar::EntryType::Regular);
        tar.append_data(&mut header, path, text.as_bytes())?;
    }
    let tarball = tar.into_inner()?;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::io::Write::write_all(&mut gz, &tarball)?;
    Ok(ChartArchive::from_bytes(gz.finish()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_demo_chart_is_the_same_bytes_every_time() {
        let a = demo_chart().unwrap();
        let b = demo_chart().unwrap();
        assert_eq!(a.bytes, b.bytes);
        assert_eq!(a.digest, b.digest);
        assert!(a.digest.starts_with("sha256:") && a.digest.len() == 7 + 64);
    }

    #[test]
    fn the_demo_chart_holds_its_three_files_under_the_chart_directory() {
        let archive = demo_chart().unwrap();
        let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(&archive.bytes[..]));
        let paths: Vec<String> = tar
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        assert_eq!(
            paths,
            [
                "demo/Chart.yaml",
                "demo/values.yaml",
                "demo/templates/configmap.yaml"
            ]
        );
    }
}
