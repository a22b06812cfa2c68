//! The release binaries' sizes, stripped.

use anyhow::Result;

use crate::release_binary;

pub struct Size {
    pub binary: &'static str,
    pub bytes: u64,
    /// After `strip` (or `objcopy --strip-all`) of a copy; `None` when
    /// neither tool is installed.
    pub stripped_bytes: Option<u64>,
}

pub const BINARIES: [&str; 3] = ["flux-plunger", "flux-plunger-drain", "flux-plunger-sweep"];

fn strip_copy(path: &std::path::Path, dir: &std::path::Path) -> Option<u64> {
    let copy = dir.join(path.file_name()?);
    std::fs::copy(path, &copy).ok()?;
    let stripped = [
        ("strip", &["--strip-all"][..]),
        ("objcopy", &["--strip-all"][..]),
    ]
    .iter()
    .any(|(tool, args)| {
        std::process::Command::new(tool)
            .args(*args)
            .arg(&copy)
            .status()
            .is_ok_and(|s| s.success())
    });
    stripped.then(|| std::fs::metadata(&copy).ok().map(|m| m.len()))?
}

pub fn sizes() -> Result<Vec<Size>> {
    let dir = tempfile::tempdir()?;
    BINARIES
        .iter()
        .map(|binary| {
            let path = release_binary(binary)?;
            Ok(Size {
                binary,
                bytes: std::fs::metadata(&path)?.len(),
                stripped_bytes: strip_copy(&path, dir.path()),
            })
        })
        .collect()
}
