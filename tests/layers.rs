//! The library's layers, checked on its real module graph.
//!
//! Reads the module tree from `src/lib.rs` (every `mod`, file or inline,
//! whatever its `cfg`), parses each file with `syn`, and resolves every path
//! that names a module of this crate — `use` trees, paths in code and types,
//! and `crate::`/`super::`/`self::` paths inside macro invocations — to the
//! module that defines it. Two rules, from the one table in
//! `scripts/layers.txt`:
//!
//! 1. a top-level module uses only modules of its own layer or below;
//! 2. at every level of the tree — the crate's top-level modules, and each
//!    module's children beside the module's own file — the uses form no
//!    cycle (a public child that uses its parent's own items while the
//!    parent uses the child is a cycle; a private child, `mod x;`, is part
//!    of its parent's implementation and may use the parent's own items).
//!
//! Doc comments and plain comments are not uses. A failure names each edge
//! with the file and line of one use that makes it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proc_macro2::{TokenStream, TokenTree};
use syn::visit::Visit;

/// A module: its absolute path below `crate` (empty for the root), the file
/// its body sits in, and the paths it uses (absolute, with one use site).
struct Module {
    file: PathBuf,
    /// Declared `pub` (any `pub(…)`), or the crate root.
    public: bool,
    uses: Vec<(Vec<String>, usize)>,
    /// `pub use` re-exports: the name this module gives an item → the
    /// item's absolute path. A re-export is naming, not a use; a use of the
    /// name counts as a use of the item where it is defined.
    reexports: BTreeMap<String, Vec<String>>,
}

/// Every module of the crate, by absolute path.
type Tree = BTreeMap<Vec<String>, Module>;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Reads `file` as module `path` (whose children's files sit in `dir`).
fn read_module(tree: &mut Tree, path: Vec<String>, public: bool, file: &Path, dir: &Path) {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let ast = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    read_items(tree, path, public, file, dir, &ast.items);
}

fn read_items(tree: &mut Tree, path: Vec<String>, public: bool, file: &Path, dir: &Path, items: &[syn::Item]) {
    let children: BTreeSet<String> = items
        .iter()
        .filter_map(|i| match i {
            syn::Item::Mod(m) => Some(m.ident.to_string()),
            _ => None,
        })
        .collect();
    let mut uses = Uses { here: &path, children: &children, found: Vec::new(), reexports: BTreeMap::new() };
    for item in items {
        match item {
            syn::Item::Mod(m) => {
                let mut child = path.clone();
                child.push(m.ident.to_string());
                let public = !matches!(m.vis, syn::Visibility::Inherited);
                match &m.content {
                    Some((_, inner)) => read_items(tree, child, public, file, &dir.join(m.ident.to_string()), inner),
                    None => {
                        let flat = dir.join(format!("{}.rs", m.ident));
                        let nested = dir.join(m.ident.to_string()).join("mod.rs");
                        let child_file = if flat.exists() { flat } else { nested };
                        read_module(tree, child, public, &child_file, &dir.join(m.ident.to_string()));
                    }
                }
            }
            other => uses.visit_item(other),
        }
    }
    let (found, reexports) = (uses.found, uses.reexports);
    tree.insert(path, Module { file: file.to_path_buf(), public, uses: found, reexports });
}

/// Collects the crate paths one module's items use, made absolute.
struct Uses<'a> {
    here: &'a [String],
    children: &'a BTreeSet<String>,
    found: Vec<(Vec<String>, usize)>,
    reexports: BTreeMap<String, Vec<String>>,
}

impl Uses<'_> {
    /// `segments` made absolute if they name this crate: `crate::…`,
    /// `super::…`, `self::…`, or a child module's name first (a lone name
    /// is a local, not a module, unless `use` says so).
    fn absolute(&self, segments: &[String], in_use: bool) -> Option<Vec<String>> {
        let first = segments.first()?;
        let mut abs: Vec<String> = match first.as_str() {
            "crate" => Vec::new(),
            "self" | "super" => self.here.to_vec(),
            name if self.children.contains(name) && (in_use || segments.len() > 1) => {
                let mut p = self.here.to_vec();
                p.extend(segments.iter().cloned());
                return Some(p);
            }
            _ => return None,
        };
        let mut rest = &segments[1..];
        if first == "super" {
            abs.pop();
            while rest.first().is_some_and(|s| s == "super") {
                abs.pop();
                rest = &rest[1..];
            }
        }
        abs.extend(rest.iter().cloned());
        Some(abs)
    }

    fn record(&mut self, segments: &[String], line: usize) {
        if let Some(abs) = self.absolute(segments, false) {
            self.found.push((abs, line));
        }
    }

    /// One `use` tree; `export` is whether the `use` is `pub` (a re-export).
    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree, export: bool) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree, export);
                prefix.pop();
            }
            syn::UseTree::Name(n) => self.use_name(prefix, &n.ident, &n.ident, export),
            syn::UseTree::Rename(r) => self.use_name(prefix, &r.ident, &r.rename, export),
            syn::UseTree::Glob(g) => {
                if let Some(abs) = self.absolute(prefix, true) {
                    self.found.push((abs, g.star_token.spans[0].start().line));
                }
            }
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.use_tree(prefix, t, export);
                }
            }
        }
    }

    fn use_name(&mut self, prefix: &[String], ident: &syn::Ident, alias: &syn::Ident, export: bool) {
        let mut p = prefix.to_vec();
        if ident != "self" {
            p.push(ident.to_string());
        }
        let Some(abs) = self.absolute(&p, true) else { return };
        if export {
            let name = if alias == "self" { prefix.last().cloned().unwrap_or_default() } else { alias.to_string() };
            self.reexports.insert(name, abs);
        } else {
            self.found.push((abs, ident.span().start().line));
        }
    }

    /// `crate :: a :: b` and `super :: …` sequences inside a macro's tokens.
    fn tokens(&mut self, tokens: TokenStream) {
        let list: Vec<TokenTree> = tokens.into_iter().collect();
        let mut i = 0;
        while i < list.len() {
            match &list[i] {
                TokenTree::Group(g) => self.tokens(g.stream()),
                TokenTree::Ident(id) if id == "crate" || id == "super" || id == "self" => {
                    let line = id.span().start().line;
                    let mut segs = vec![id.to_string()];
                    let mut j = i + 1;
                    while is_colon2(&list, j) {
                        let Some(TokenTree::Ident(next)) = list.get(j + 2) else { break };
                        segs.push(next.to_string());
                        j += 3;
                    }
                    if segs.len() > 1 {
                        self.record(&segs, line);
                    }
                    i = j.max(i + 1);
                    continue;
                }
                _ => {}
            }
            i += 1;
        }
    }
}

fn is_colon2(list: &[TokenTree], j: usize) -> bool {
    matches!((list.get(j), list.get(j + 1)),
        (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b))) if a.as_char() == ':' && b.as_char() == ':')
}

impl<'ast> Visit<'ast> for Uses<'_> {
    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        let export = !matches!(u.vis, syn::Visibility::Inherited);
        self.use_tree(&mut Vec::new(), &u.tree, export);
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        let segs: Vec<String> = p.segments.iter().map(|s| s.ident.to_string()).collect();
        if let Some(first) = p.segments.first() {
            self.record(&segs, first.ident.span().start().line);
        }
        syn::visit::visit_path(self, p);
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        self.visit_path(&m.path);
        self.tokens(m.tokens.clone());
    }

    // Items nested in functions can hold `mod`s only in theory; their uses
    // are this module's uses, which the default visit already collects.
}

/// The module that defines `path`: its longest prefix that is a module,
/// after following that module's re-export of the next name, if any.
fn owner<'a>(tree: &'a Tree, path: &[String]) -> Option<&'a Vec<String>> {
    let mut path = path.to_vec();
    for _ in 0..16 {
        let (module, m) = (0..=path.len()).rev().find_map(|n| tree.get_key_value(&path[..n]))?;
        let next = path.get(module.len()).and_then(|name| m.reexports.get(name));
        match next {
            Some(target) => {
                let mut followed = target.clone();
                followed.extend(path[module.len() + 1..].iter().cloned());
                path = followed;
            }
            None => return Some(module),
        }
    }
    None
}

/// The layer of each top-level module, from `scripts/layers.txt`.
fn layer_table() -> BTreeMap<String, usize> {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/layers.txt");
    let text = std::fs::read_to_string(&file).expect("scripts/layers.txt");
    let mut table = BTreeMap::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("");
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        let layer: usize = first.parse().unwrap_or_else(|_| panic!("layers.txt: bad layer in {line:?}"));
        for m in words {
            // The third column (a description) starts where a word is not a
            // module name; descriptions are commented, so every word counts.
            assert!(table.insert(m.to_string(), layer).is_none(), "layers.txt names {m} twice");
        }
    }
    table
}

/// One edge of the module graph with one use site that makes it.
type Edges = BTreeMap<(Vec<String>, Vec<String>), (PathBuf, usize)>;

/// Every use between two different modules, at module granularity.
fn edges(tree: &Tree) -> Edges {
    let mut out = Edges::new();
    for (from, m) in tree {
        for (path, line) in &m.uses {
            if let Some(to) = owner(tree, path) {
                if to != from {
                    out.entry((from.clone(), to.clone())).or_insert((m.file.clone(), *line));
                }
            }
        }
    }
    out
}

/// The node of the graph at `parent`'s level that `module` belongs to:
/// `parent` itself (its own file) or the child whose subtree holds it.
fn lift(parent: &[String], module: &[String]) -> Option<Vec<String>> {
    if !module.starts_with(parent) {
        return None;
    }
    Some(module[..(parent.len() + 1).min(module.len())].to_vec())
}

/// The groups of nodes of `graph` that reach each other (its strongly
/// connected components of more than one node): each is a cycle.
fn cycles(graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<Vec<String>>> {
    let reach = |from: &Vec<String>| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(n) = todo.pop() {
            for next in graph.get(&n).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&Vec<String>, BTreeSet<Vec<String>>> = graph.keys().map(|n| (n, reach(n))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for (n, r) in &reaches {
        if done.contains(*n) || !r.contains(*n) {
            continue;
        }
        let group: Vec<Vec<String>> =
            r.iter().filter(|m| reaches.get(m).is_some_and(|back| back.contains(*n))).cloned().collect();
        done.extend(group.iter().cloned());
        out.push(group);
    }
    out
}

fn name(path: &[String]) -> String {
    if path.is_empty() { "crate".into() } else { path.join("::") }
}

fn site(edges: &Edges, from_level: &[String], to_level: &[String], parent: &[String]) -> String {
    edges
        .iter()
        .find(|((f, t), _)| {
            lift(parent, f).as_deref() == Some(from_level) && lift(parent, t).as_deref() == Some(to_level)
        })
        .map(|((f, t), (file, line))| {
            let rel = file.strip_prefix(Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap_or(file);
            format!("{}:{line} ({} uses {})", rel.display(), name(f), name(t))
        })
        .unwrap_or_default()
}

fn read_tree() -> Tree {
    let mut tree = Tree::new();
    read_module(&mut tree, Vec::new(), true, &src().join("lib.rs"), &src());
    tree
}

#[test]
fn every_top_level_module_uses_only_its_layer_or_below() {
    let tree = read_tree();
    let table = layer_table();
    let mut unlisted = Vec::new();
    for top in tree.keys().filter(|p| p.len() == 1) {
        if !table.contains_key(&top[0]) {
            unlisted.push(top[0].clone());
        }
    }
    assert!(unlisted.is_empty(), "scripts/layers.txt gives no layer to: {unlisted:?}");
    let edges = edges(&tree);
    let mut upward = Vec::new();
    for ((from, to), (file, line)) in &edges {
        let (Some(f), Some(t)) = (from.first(), to.first()) else { continue };
        if table[f] < table[t] {
            let rel = file.strip_prefix(Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap_or(file);
            upward.push(format!(
                "{}:{line}: {} (layer {}) uses {} (layer {})",
                rel.display(),
                name(from),
                table[f],
                name(to),
                table[t]
            ));
        }
    }
    assert!(upward.is_empty(), "uses that run up the layers:\n{}", upward.join("\n"));
    // The checker reads what it claims to: the crate has many modules and
    // the graph many edges (an empty parse would pass vacuously).
    assert!(tree.len() > 40 && edges.len() > 100, "read {} modules, {} edges", tree.len(), edges.len());
    eprintln!("layers: {} modules, {} edges between modules, none upward", tree.len(), edges.len());
}

#[test]
fn no_level_of_the_module_tree_has_a_cycle() {
    let tree = read_tree();
    let edges = edges(&tree);
    let mut found = Vec::new();
    let mut levels = 0;
    for parent in tree.keys() {
        let mut graph: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
        for (from, to) in edges.keys() {
            let (Some(f), Some(t)) = (lift(parent, from), lift(parent, to)) else { continue };
            // A private child is its parent's implementation: it may use the
            // parent's own items.
            let private_child_up = &t == parent && !tree[&f].public;
            if f != t && !private_child_up {
                graph.entry(f).or_default().insert(t);
            }
        }
        levels += 1;
        for group in cycles(&graph) {
            let mut steps = Vec::new();
            for a in &group {
                for b in graph.get(a).into_iter().flatten().filter(|b| group.contains(b)) {
                    steps.push(site(&edges, a, b, parent));
                }
            }
            found.push(format!(
                "under {}: {} use each other\n    {}",
                name(parent),
                group.iter().map(|c| name(c)).collect::<Vec<_>>().join(", "),
                steps.join("\n    ")
            ));
        }
    }
    assert!(found.is_empty(), "module cycles:\n{}", found.join("\n"));
    eprintln!("layers: {levels} levels of the module tree, no cycle");
}

#[test]
fn the_checker_sees_super_self_child_and_macro_paths() {
    // A hand-made tree: `a` uses `b` through `super::`, `b` uses `a::x` in a
    // macro, `a` has a child `c` used by bare name. The checker must find
    // all three edges and the a <-> b cycle.
    let text_a = "use super::b::Thing; fn f() { c::g(); }";
    let text_b = "fn h() { tracing::info!(target: crate::a::x::T, \"x\"); }";
    let mut tree = Tree::new();
    let root = Module { file: "lib.rs".into(), public: true, uses: Vec::new(), reexports: BTreeMap::new() };
    tree.insert(Vec::new(), root);
    for (name, text, children) in [("a", text_a, vec!["c", "x"]), ("b", text_b, vec![])] {
        let ast = syn::parse_file(text).unwrap();
        let here = vec![name.to_string()];
        let kids: BTreeSet<String> = children.iter().map(|s| s.to_string()).collect();
        let mut uses = Uses { here: &here, children: &kids, found: Vec::new(), reexports: BTreeMap::new() };
        uses.visit_file(&ast);
        let module =
            Module { file: format!("{name}.rs").into(), public: true, uses: uses.found, reexports: uses.reexports };
        tree.insert(here.clone(), module);
        for k in children {
            let kid = Module { file: "k.rs".into(), public: true, uses: Vec::new(), reexports: BTreeMap::new() };
            tree.insert(vec![name.to_string(), k.to_string()], kid);
        }
    }
    let e = edges(&tree);
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert!(e.contains_key(&(s(&["a"]), s(&["b"]))), "super:: path missed: {:?}", e.keys());
    assert!(e.contains_key(&(s(&["a"]), s(&["a", "c"]))), "child-name path missed");
    assert!(e.contains_key(&(s(&["b"]), s(&["a", "x"]))), "macro path missed");
    let mut graph: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (f, t) in e.keys() {
        let (Some(f), Some(t)) = (lift(&[], f), lift(&[], t)) else { continue };
        if f != t {
            graph.entry(f).or_default().insert(t);
        }
    }
    assert_eq!(cycles(&graph), vec![vec![s(&["a"]), s(&["b"])]], "the a <-> b cycle was not found");
}
