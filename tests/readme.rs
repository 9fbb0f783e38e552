//! The README's library section and `examples/library.rs` are one program: its first ```rust block is the example,
//! byte for byte, and the ```toml block before it names every crate the example uses. No database.

use std::collections::BTreeSet;

const README: &str = include_str!("../README.md");
const EXAMPLE: &str = include_str!("../examples/library.rs");

/// Where the body of the first fenced block opened by exactly "```<lang>" at or after `from` starts and ends.
fn fenced_block(text: &str, lang: &str, from: usize) -> Option<(usize, usize)> {
    let opening = format!("```{lang}\n");
    let mut at = from;
    loop {
        let start = at + text[at..].find(&opening)?;
        at = start + opening.len();
        // Only a fence that opens a line.
        if start == 0 || text.as_bytes()[start - 1] == b'\n' {
            break;
        }
    }
    let end = at + text[at..].find("\n```\n").map(|i| i + 1)?;
    Some((at, end))
}

/// Crates named by `use` lines at the top level (not indented), and by paths like `sqlx::query(` anywhere: the
/// lower-case first segment of a path that is not a method's turbofish, nor a name the `use` lines brought in.
fn crates_used(source: &str) -> BTreeSet<String> {
    const NOT_CRATES: &[&str] = &["std", "core", "alloc", "crate", "self", "super", "Self"];
    let mut crates = BTreeSet::new();
    let mut imported = BTreeSet::new();
    for line in source.lines() {
        let Some(path) = line.strip_prefix("use ") else { continue };
        let first = path.split(|c: char| !(c.is_alphanumeric() || c == '_')).next().unwrap_or_default();
        crates.insert(first.to_owned());
        // The last segment of each name a `use` brings in can itself start a path (`env::var`), braces included
        // (`use std::{env, time::Duration};`).
        let names = match path.split_once('{') {
            Some((_, inner)) => inner.trim_end_matches(';').trim_end_matches('}').split(',').collect(),
            None => vec![path.trim_end_matches(';')],
        };
        for name in names {
            imported.insert(name.trim().rsplit("::").next().unwrap_or_default().to_owned());
        }
    }
    // Paths outside the `use` lines, which were read above.
    let source: String = source.lines().filter(|l| !l.starts_with("use ")).collect::<Vec<_>>().join("\n");
    let source = source.as_str();
    let bytes = source.as_bytes();
    for (i, _) in source.match_indices("::") {
        let start = source[..i].rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |j| j + 1);
        let segment = &source[start..i];
        // `a::b` (after a path) and `x.method::<T>` (a turbofish) name no crate.
        let after_path = (start >= 2 && &bytes[start - 2..start] == b"::") || (start >= 1 && bytes[start - 1] == b'.');
        let lowercase = segment.chars().next().is_some_and(|c| c.is_ascii_lowercase());
        if !segment.is_empty() && lowercase && !after_path && !imported.contains(segment) {
            crates.insert(segment.to_owned());
        }
    }
    crates.retain(|c| !NOT_CRATES.contains(&c.as_str()));
    crates
}

/// The dependency names of a `[dependencies]` table, with `-` read as `_` (as Rust paths name them).
fn dependencies(toml: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut in_dependencies = false;
    for line in toml.lines().map(str::trim) {
        if line.starts_with('[') {
            in_dependencies = line == "[dependencies]";
        } else if in_dependencies && let Some((name, _)) = line.split_once('=') {
            names.insert(name.trim().replace('-', "_"));
        }
    }
    names
}

#[test]
fn the_readme_program_is_examples_library_rs_and_its_toml_names_every_crate_it_uses() {
    let section = README.find("## Quick start").expect("the README has a quick start");
    let (rust_at, rust_end) = fenced_block(README, "rust", 0).expect("the README has a ```rust block");
    let first_rust = &README[rust_at..rust_end];
    assert!(rust_at > section, "the first ```rust block of the README stands in its quick start");
    assert!(
        first_rust == EXAMPLE,
        "the README's first ```rust block differs from examples/library.rs: copy the file into the block, byte for \
         byte"
    );

    let (toml_at, toml_end) = fenced_block(README, "toml", section).expect("a ```toml block in the quick start");
    let toml = &README[toml_at..toml_end];
    assert!(toml_end < rust_at, "the ```toml block comes before the program");
    assert!(toml.contains("[dependencies]"), "the ```toml block is a [dependencies] table");
    assert!(
        toml.contains("conveyor-jobs = { path = "),
        "conveyor-jobs is a path dependency (the crate is not published)"
    );
    let declared = dependencies(toml);
    let used = crates_used(EXAMPLE);
    let missing: Vec<&String> = used.difference(&declared).collect();
    assert!(missing.is_empty(), "the README's [dependencies] lack {missing:?} (declared: {declared:?})");
}

#[test]
fn the_crate_finder_reads_use_lines_and_paths() {
    let source = "use std::{fs, time::Duration};\nuse std::env;\nuse anyhow::Context;\nuse tokio_util::sync::CancellationToken;\n\
                  fn f() { env::var(\"X\"); fs::read(\"\"); sqlx::query(\"\"); conveyor_jobs::Dispatcher::connect; Foo::bar(); }\n\
                  fn g() { w.handle::<K>(); }\n";
    let found: Vec<String> = crates_used(source).into_iter().collect();
    assert_eq!(found, ["anyhow", "conveyor_jobs", "sqlx", "tokio_util"]);
    assert_eq!(
        dependencies(
            "[dependencies]\ntokio-util = \"0.7\"\nserde = { version = \"1\" }\n[dev-dependencies]\nx = \"1\"\n"
        ),
        ["serde".to_owned(), "tokio_util".to_owned()].into_iter().collect()
    );
}
