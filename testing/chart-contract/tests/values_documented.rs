//! Every value of the chart is documented by a `# --` comment in values.yaml
//! and typed by a property of values.schema.json, and the two agree. The values
//! are read by helm-docs, the tool that writes chart/README.md's values table
//! from those comments (`make chart-docs`; `make chart-docs-check` fails when
//! the committed README is not what it writes).

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{Context, Result, bail};
use chart_contract::chart_dir;
use serde::Deserialize;
use serde_json::Value;

/// One row of helm-docs' values table.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Row {
    key: String,
    /// From a `# key -- text` comment, which this chart does not use.
    description: String,
    /// From the `# --` comment above the key.
    auto_description: String,
}

impl Row {
    fn documented(&self) -> bool {
        !self.description.is_empty() || !self.auto_description.is_empty()
    }
}

/// The rows helm-docs makes of the chart in `chart`: one for each value with a
/// `# --` comment (a documented map or list is one row, whatever it holds),
/// and one without a description for each leaf no comment covers.
fn helm_docs_rows(chart: &Path) -> Result<Vec<Row>> {
    let template = tempfile::Builder::new().suffix(".gotmpl").tempfile()?;
    std::fs::write(template.path(), "{{ toJson .Values }}\n")?;
    let output = std::process::Command::new(testkit::control_plane::tool("helm-docs")?)
        .arg("--chart-search-root")
        .arg(chart)
        .arg("--template-files")
        .arg(template.path())
        .args(["--dry-run", "--log-level", "warn"])
        .output()
        .context("running helm-docs")?;
    // helm-docs logs a failure (and exits 0) rather than failing.
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() || !stderr.trim().is_empty() {
        bail!("helm-docs failed ({}): {stderr}", output.status);
    }
    serde_json::from_slice(&output.stdout).context("helm-docs' rows")
}

fn resolve<'a>(schema: &'a Value, node: &'a Value) -> &'a Value {
    match node["$ref"].as_str() {
        Some(reference) => reference
            .strip_prefix("#/")
            .map(|p| p.split('/').fold(schema, |n, key| &n[key]))
            .unwrap_or(node),
        None => node,
    }
}

/// Every property path of the schema, down to the documented values.
fn schema_paths(
    schema: &Value,
    node: &Value,
    prefix: &str,
    documented: &BTreeSet<String>,
    out: &mut BTreeSet<String>,
) {
    let node = resolve(schema, node);
    for (key, child) in node["properties"].as_object().into_iter().flatten() {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        out.insert(path.clone());
        if !documented.contains(&path) {
            schema_paths(schema, child, &path, documented, out);
        }
    }
}

#[test]
fn every_value_has_a_doc_comment_and_a_schema_property() -> Result<()> {
    let rows = helm_docs_rows(&chart_dir())?;
    let undocumented: Vec<&str> = rows
        .iter()
        .filter(|row| !row.documented())
        .map(|row| row.key.as_str())
        .collect();
    assert!(
        undocumented.is_empty(),
        "values.yaml has values without a `# --` comment: {undocumented:?}"
    );
    let documented: BTreeSet<String> = rows.into_iter().map(|row| row.key).collect();
    assert!(
        documented.contains("shutdownGracePeriodSeconds")
            && documented.contains("image.digest")
            && documented.contains("controller.resources"),
        "helm-docs found too little: {documented:?}"
    );

    let schema: Value = serde_json::from_str(&std::fs::read_to_string(
        chart_dir().join("values.schema.json"),
    )?)?;
    let mut paths = BTreeSet::new();
    schema_paths(&schema, &schema, "", &documented, &mut paths);
    for value in &documented {
        assert!(
            paths.contains(value),
            "{value} is documented but values.schema.json has no property for it"
        );
    }
    for path in &paths {
        assert!(
            documented.contains(path)
                || documented
                    .iter()
                    .any(|d| d.starts_with(&format!("{path}."))),
            "values.schema.json has {path}, which values.yaml neither sets nor documents"
        );
    }
    Ok(())
}

#[test]
fn every_object_level_of_the_schema_refuses_unknown_keys() -> Result<()> {
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(
        chart_dir().join("values.schema.json"),
    )?)?;
    fn walk(node: &Value, at: &str) -> Result<usize> {
        let mut checked = 0;
        if let Some(properties) = node["properties"].as_object() {
            if node["additionalProperties"] != Value::Bool(false) {
                bail!("{at} lists properties but does not set additionalProperties: false");
            }
            checked += 1;
            for (key, child) in properties {
                checked += walk(child, &format!("{at}/{key}"))?;
            }
        }
        for key in ["items", "additionalProperties"] {
            if node[key].is_object() {
                checked += walk(&node[key], &format!("{at}/{key}"))?;
            }
        }
        for (key, definition) in node["definitions"].as_object().into_iter().flatten() {
            checked += walk(definition, &format!("{at}/definitions/{key}"))?;
        }
        Ok(checked)
    }
    let checked = walk(&schema, "").context("values.schema.json")?;
    assert!(checked > 10, "only {checked} object levels found");
    Ok(())
}

/// What the check above relies on helm-docs for: a value no `# --` comment
/// covers is a row without a description, not a missing row, and a documented
/// map is one row.
#[test]
fn helm_docs_lists_an_undocumented_value_without_a_description() -> Result<()> {
    let chart = tempfile::tempdir()?;
    std::fs::write(
        chart.path().join("Chart.yaml"),
        "apiVersion: v2\nname: probe\nversion: 0.1.0\n",
    )?;
    std::fs::write(
        chart.path().join("values.yaml"),
        "# -- documented\na: 1\n# -- a map documented whole\nb:\n  c: 2\nd:\n  # plain\n  e: 3\n",
    )?;
    let rows: Vec<(String, bool)> = helm_docs_rows(chart.path())?
        .into_iter()
        .map(|row| {
            let documented = row.documented();
            (row.key, documented)
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("a".to_owned(), true),
            ("b".to_owned(), true),
            ("d.e".to_owned(), false)
        ]
    );
    Ok(())
}
