//! Every value of the chart is documented three times, and the three agree:
//! a `# --` comment in values.yaml, a property of values.schema.json, and a
//! row of the values table in chart/README.md.

use std::collections::BTreeSet;

use anyhow::{Context, Result, bail};
use chart_contract::chart_dir;
use serde_json::Value;

/// The documented values of values.yaml, by dotted path: a key whose comment
/// block starts with `# --` documents itself and everything below it; a key
/// with nothing after its colon is a group whose children must each be
/// documented; anything else is an error.
fn documented_values(text: &str) -> Result<Vec<String>> {
    let lines: Vec<&str> = text.lines().collect();
    let mut stack: Vec<(usize, String)> = Vec::new();
    let mut documented: Vec<String> = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') || trimmed.starts_with("- ") {
            continue;
        }
        let indent = line.len() - trimmed.len();
        let Some((key, rest)) = trimmed.split_once(':') else {
            continue;
        };
        if key.contains(' ') {
            continue;
        }
        while stack.last().is_some_and(|(level, _)| *level >= indent) {
            stack.pop();
        }
        let path = match stack.last() {
            Some((_, parent)) => format!("{parent}.{key}"),
            None => key.to_owned(),
        };
        stack.push((indent, path.clone()));
        if documented
            .iter()
            .any(|d| path.starts_with(&format!("{d}.")))
        {
            continue;
        }
        let comment_block: Vec<&str> = lines[..i]
            .iter()
            .rev()
            .take_while(|l| l.trim_start().starts_with('#'))
            .copied()
            .collect();
        match comment_block.last() {
            Some(first) if first.trim_start().starts_with("# -- ") => documented.push(path),
            _ if rest.trim().is_empty() => {}
            _ => bail!("values.yaml line {}: {path} has no `# --` comment", i + 1),
        }
    }
    Ok(documented)
}

/// The keys of the values table of chart/README.md: the first cell of each
/// row, in backquotes.
fn readme_rows(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once("` |").map(|(key, _)| key.to_owned()))
        .collect()
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
fn every_value_has_a_doc_comment_a_schema_property_and_a_readme_row() -> Result<()> {
    let values = std::fs::read_to_string(chart_dir().join("values.yaml"))?;
    let documented: BTreeSet<String> = documented_values(&values)?.into_iter().collect();
    assert!(
        documented.contains("shutdownGracePeriodSeconds") && documented.contains("image.digest"),
        "the parser found too little: {documented:?}"
    );

    let readme = std::fs::read_to_string(chart_dir().join("README.md"))?;
    assert_eq!(
        readme_rows(&readme),
        documented,
        "chart/README.md's values table and values.yaml's `# --` comments disagree"
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

#[test]
fn the_values_parser_refuses_an_undocumented_value() {
    let err = documented_values("# -- documented\na: 1\nb:\n  c: 2\n").unwrap_err();
    assert!(
        err.to_string().contains("b.c has no `# --` comment"),
        "{err}"
    );
    assert_eq!(
        documented_values("# -- a group documented whole\nb:\n  c: 2\n# plain\n# -- no\nd: 1\n")
            .unwrap_err()
            .to_string(),
        "values.yaml line 6: d has no `# --` comment"
    );
}
