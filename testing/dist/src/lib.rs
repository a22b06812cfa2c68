//! Dev-only: reads back what `make dist` published, as a user or a scanner
//! reads a release: an OCI image layout (`cosign save` of the pushed index),
//! the image layers' files, and the ELF binaries in them, down to the crate
//! graph `cargo auditable` embeds. The test itself is `tests/dist.rs`.
#![forbid(unsafe_code)]

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// An OCI image layout on disk (`oci-layout`, `index.json`, `blobs/`).
pub struct Layout {
    dir: PathBuf,
}

impl Layout {
    pub fn open(dir: &Path) -> Result<Self> {
        ensure!(
            dir.join("oci-layout").is_file(),
            "{} is not an OCI image layout",
            dir.display()
        );
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    /// The layout's own `index.json`.
    pub fn index(&self) -> Result<Value> {
        let path = self.dir.join("index.json");
        Ok(serde_json::from_slice(
            &std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?,
        )?)
    }

    /// The blob of `digest` (`sha256:…`), refused unless its content hashes
    /// to that digest.
    pub fn blob(&self, digest: &str) -> Result<Vec<u8>> {
        let hex = digest
            .strip_prefix("sha256:")
            .with_context(|| format!("not a sha256 digest: {digest}"))?;
        let path = self.dir.join("blobs").join("sha256").join(hex);
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        ensure!(
            sha256(&bytes) == digest,
            "the blob {digest} hashes to {}",
            sha256(&bytes)
        );
        Ok(bytes)
    }

    /// The blob of `digest`, parsed as JSON (a manifest, an index, a config).
    pub fn json(&self, digest: &str) -> Result<Value> {
        serde_json::from_slice(&self.blob(digest)?)
            .with_context(|| format!("the blob {digest} is not JSON"))
    }
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256(bytes: &[u8]) -> String {
    let hash = Sha256::digest(bytes);
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// A string field of a JSON value, or an error naming it.
pub fn str_field<'a>(value: &'a Value, pointer: &str) -> Result<&'a str> {
    value
        .pointer(pointer)
        .and_then(Value::as_str)
        .with_context(|| format!("no string at {pointer} in {value}"))
}

/// The regular files of a gzip-compressed tar layer, by path (without a
/// leading `./` or `/`).
pub fn layer_files(layer: &[u8]) -> Result<Vec<(String, Vec<u8>)>> {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(layer));
    let mut files = Vec::new();
    for entry in archive.entries()? {
        let mut entry = entry?;
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let path = entry.path()?.to_string_lossy().into_owned();
        let path = path.trim_start_matches("./").trim_start_matches('/');
        let mut bytes = Vec::new();
        entry.read_to_end(&mut bytes)?;
        files.push((path.to_owned(), bytes));
    }
    Ok(files)
}

/// ELF `e_machine` of x86-64.
pub const EM_X86_64: u16 = 62;
/// ELF `e_machine` of AArch64.
pub const EM_AARCH64: u16 = 183;
/// The program header asking for a loader: a dynamically linked binary.
const PT_INTERP: u32 = 3;

/// A 64-bit little-endian ELF file, read only as far as these checks need.
pub struct Elf<'a> {
    bytes: &'a [u8],
}

impl<'a> Elf<'a> {
    pub fn parse(bytes: &'a [u8]) -> Result<Self> {
        ensure!(
            bytes.len() >= 64 && bytes.starts_with(b"\x7fELF"),
            "not an ELF file"
        );
        ensure!(bytes[4] == 2, "not a 64-bit ELF file (class {})", bytes[4]);
        ensure!(bytes[5] == 1, "not a little-endian ELF file");
        Ok(Self { bytes })
    }

    fn u16_at(&self, at: usize) -> Result<u16> {
        let b = self.bytes.get(at..at + 2).context("ELF file cut short")?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32_at(&self, at: usize) -> Result<u32> {
        let b = self.bytes.get(at..at + 4).context("ELF file cut short")?;
        Ok(u32::from_le_bytes(b.try_into()?))
    }

    fn u64_at(&self, at: usize) -> Result<usize> {
        let b = self.bytes.get(at..at + 8).context("ELF file cut short")?;
        Ok(usize::try_from(u64::from_le_bytes(b.try_into()?))?)
    }

    /// `e_machine`: the architecture the binary runs on.
    pub fn machine(&self) -> Result<u16> {
        self.u16_at(18)
    }

    /// True when no program header asks for a loader: a `FROM scratch` image
    /// has none.
    pub fn is_static(&self) -> Result<bool> {
        let (offset, size, count) = (self.u64_at(32)?, self.u16_at(54)?, self.u16_at(56)?);
        for i in 0..usize::from(count) {
            if self.u32_at(offset + i * usize::from(size))? == PT_INTERP {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The contents of the section called `name`, if there is one.
    pub fn section(&self, name: &str) -> Result<Option<&'a [u8]>> {
        let (offset, size, count) = (self.u64_at(40)?, self.u16_at(58)?, self.u16_at(60)?);
        let header = |i: usize| offset + i * usize::from(size);
        let names = header(usize::from(self.u16_at(62)?));
        let names_offset = self.u64_at(names + 24)?;
        for i in 0..usize::from(count) {
            let start = names_offset + usize::try_from(self.u32_at(header(i))?)?;
            let found = self
                .bytes
                .get(start..)
                .and_then(|rest| rest.split(|b| *b == 0).next())
                .context("a section name outside the file")?;
            if found == name.as_bytes() {
                let (at, len) = (self.u64_at(header(i) + 24)?, self.u64_at(header(i) + 32)?);
                return Ok(Some(
                    self.bytes
                        .get(at..at + len)
                        .with_context(|| format!("section {name} outside the file"))?,
                ));
            }
        }
        Ok(None)
    }
}

/// The crate graph `cargo auditable` embedded in a binary: its `.dep-v0`
/// section, zlib-compressed JSON (`{"packages": [{"name", "version",
/// "source", …}]}`).
pub fn audit_data(elf: &Elf) -> Result<Value> {
    let Some(section) = elf.section(".dep-v0")? else {
        bail!("no .dep-v0 section: not built by cargo auditable");
    };
    let mut json = Vec::new();
    flate2::read::ZlibDecoder::new(section)
        .read_to_end(&mut json)
        .context("the .dep-v0 section is not zlib data")?;
    serde_json::from_slice(&json).context("the .dep-v0 section is not JSON")
}

/// `(name, version)` of every crate of an audit-data document.
pub fn crates(audit: &Value) -> Result<Vec<(String, String)>> {
    audit["packages"]
        .as_array()
        .context("audit data without packages")?
        .iter()
        .map(|p| {
            Ok((
                str_field(p, "/name")?.to_owned(),
                str_field(p, "/version")?.to_owned(),
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    // This test binary: a dynamically linked ELF of this machine, and no
    // crate graph (a test build is no cargo auditable build).
    #[test]
    fn the_elf_reader_tells_this_test_binary_for_what_it_is() -> Result<()> {
        let bytes = std::fs::read(std::env::current_exe()?)?;
        let elf = Elf::parse(&bytes)?;
        let machine = match std::env::consts::ARCH {
            "x86_64" => EM_X86_64,
            "aarch64" => EM_AARCH64,
            other => bail!("no ELF machine known here for {other}"),
        };
        assert_eq!(elf.machine()?, machine);
        assert!(!elf.is_static()?, "a test binary asks for the loader");
        assert!(elf.section(".text")?.is_some_and(|text| !text.is_empty()));
        assert!(elf.section(".dep-v0")?.is_none());
        assert!(audit_data(&elf).is_err());
        Ok(())
    }

    #[test]
    fn a_blob_whose_content_does_not_hash_to_its_name_is_refused() -> Result<()> {
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("oci-layout"), "{}")?;
        let blobs = dir.path().join("blobs").join("sha256");
        std::fs::create_dir_all(&blobs)?;
        let digest = sha256(b"what was pushed");
        std::fs::write(
            blobs.join(digest.trim_start_matches("sha256:")),
            b"what was pushed",
        )?;
        let layout = Layout::open(dir.path())?;
        assert_eq!(layout.blob(&digest)?, b"what was pushed");
        std::fs::write(
            blobs.join(digest.trim_start_matches("sha256:")),
            b"something else",
        )?;
        assert!(layout.blob(&digest).is_err());
        Ok(())
    }
}
