//! The README's "Embedding kvferry" snippet is the body of
//! `examples/embed_readme.rs` (which `cargo test --all-targets` builds and
//! the test command runs), so the snippet compiles as written: the two must
//! not drift apart.

/// The first ```rust block after `## Embedding kvferry` in the README.
fn readme_snippet(readme: &str) -> &str {
    let section = readme.find("## Embedding kvferry").expect("README has an Embedding kvferry section");
    let rest = &readme[section..];
    let start = rest.find("```rust\n").expect("a rust block in the section") + "```rust\n".len();
    let len = rest[start..].find("```\n").expect("the rust block ends");
    &rest[start..start + len]
}

/// The lines between `// README-BEGIN` and `// README-END`, less the
/// function body's indentation.
fn example_region(example: &str) -> String {
    let begin = example.find("    // README-BEGIN\n").expect("README-BEGIN marker") + "    // README-BEGIN\n".len();
    let end = example.find("    // README-END\n").expect("README-END marker");
    example[begin..end].lines().map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l))).collect()
}

#[test]
fn readme_embedding_snippet_is_the_compiled_example() {
    let root = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).expect("README.md");
    let example = std::fs::read_to_string(format!("{root}/examples/embed_readme.rs")).expect("example");
    let snippet = readme_snippet(&readme);
    let region = example_region(&example);
    assert!(
        snippet == region,
        "README's Embedding kvferry snippet differs from examples/embed_readme.rs (README-BEGIN..README-END); \
         copy the example's region into the README.\n--- README ---\n{snippet}\n--- example ---\n{region}"
    );
}
