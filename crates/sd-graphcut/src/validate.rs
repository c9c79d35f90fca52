//! Validation of a plan against a graph, before it is used or reused from the cache.
//!
//! A plan is valid for a graph when it was made for its structure (fingerprint and counts),
//! every node is owned by exactly one segment (other segments computing it list it as
//! recomputed), every cut is the output of exactly one segment of its group, every source
//! of every computed node is computed by the same segment or received as an input of the
//! right kind, previous-cut inputs come from strictly earlier segments, and the liveness
//! sets are exact. Errors name the node concerned.

use crate::error::{GraphCutError, Result};
use crate::liveness;
use crate::marks::CutName;
use crate::plan::{InputKind, Plan, SegmentKind};
use crate::view::{GraphView, TensorRef};

/// Checks that `plan` fits `view`; see the module documentation for what is checked.
pub fn validate(plan: &Plan, view: &GraphView) -> Result<()> {
    let _span = tracing::trace_span!("validate_plan", segments = plan.segments.len()).entered();
    if plan.fingerprint != view.fingerprint() {
        return Err(GraphCutError::FingerprintMismatch {
            plan: plan.fingerprint.to_string(),
            graph: view.fingerprint().to_string(),
        });
    }
    let nodes = view.nodes();
    let n = nodes.len();
    if plan.n_nodes != n || plan.n_leaves != view.leaves().len() {
        return Err(GraphCutError::InvalidPlan {
            node: "graph".into(),
            detail: format!(
                "plan for {} nodes and {} leaves, graph has {} and {}",
                plan.n_nodes,
                plan.n_leaves,
                n,
                view.leaves().len()
            ),
        });
    }
    let node_err = |i: usize, detail: String| GraphCutError::InvalidPlan {
        node: view.describe(TensorRef::Node(i)),
        detail,
    };
    let seg_err = |k: usize, detail: String| GraphCutError::InvalidPlan {
        node: format!(
            "segment {k} '{}'",
            plan.segments.get(k).map_or("?", |s| s.name.as_str())
        ),
        detail,
    };
    if n > 0 && plan.segments.is_empty() {
        return Err(seg_err(
            0,
            "a graph with nodes needs at least one segment".into(),
        ));
    }

    // Producers of cuts and owners of nodes.
    let mut producer: Vec<Option<usize>> = vec![None; n];
    let mut owner: Vec<Option<usize>> = vec![None; n];
    let mut internal_stamp = vec![0u32; n];
    let mut recomputed_stamp = vec![0u32; n];
    for (k, s) in plan.segments.iter().enumerate() {
        let epoch = k as u32 + 1;
        if s.outputs.is_empty() {
            return Err(seg_err(k, "has no outputs".into()));
        }
        let mut prev: Option<usize> = None;
        for &m in &s.internal_nodes {
            if m >= n {
                return Err(seg_err(
                    k,
                    format!("node index {m} is out of range ({n} nodes)"),
                ));
            }
            if prev.is_some_and(|p| p >= m) {
                return Err(node_err(
                    m,
                    format!("listed twice or out of order in segment {k} '{}'", s.name),
                ));
            }
            prev = Some(m);
            internal_stamp[m] = epoch;
        }
        let mut prev: Option<usize> = None;
        for &m in &s.recomputed_nodes {
            if m >= n || internal_stamp[m] != epoch {
                return Err(seg_err(
                    k,
                    format!("recomputed node {m} is not computed by the segment"),
                ));
            }
            if prev.is_some_and(|p| p >= m) {
                return Err(node_err(
                    m,
                    format!("listed twice or out of order as recomputed in segment {k}"),
                ));
            }
            prev = Some(m);
            recomputed_stamp[m] = epoch;
        }
        for &m in &s.internal_nodes {
            if recomputed_stamp[m] != epoch {
                if let Some(o) = owner[m] {
                    return Err(node_err(
                        m,
                        format!(
                            "owned by segments {o} and {k}; one of them must list it as recomputed"
                        ),
                    ));
                }
                owner[m] = Some(k);
            }
        }
        for o in &s.outputs {
            if o.node >= n {
                return Err(seg_err(
                    k,
                    format!("output {} has node index {} out of range", o.name, o.node),
                ));
            }
            if internal_stamp[o.node] != epoch {
                return Err(node_err(
                    o.node,
                    format!(
                        "is output '{}' of segment {k} '{}' but the segment does not compute it",
                        o.name, s.name
                    ),
                ));
            }
            match (&nodes[o.node].cut, s.kind) {
                (Some(c), SegmentKind::Cut) => {
                    if c.name != o.name || c.name.group() != s.name || !o.is_cut {
                        return Err(node_err(
                            o.node,
                            format!(
                                "is cut '{}' but appears as output '{}' of segment {k} '{}'",
                                c.name, o.name, s.name
                            ),
                        ));
                    }
                    if recomputed_stamp[o.node] == epoch {
                        return Err(node_err(
                            o.node,
                            format!(
                                "cut '{}' is listed as recomputed by its own segment {k}",
                                c.name
                            ),
                        ));
                    }
                    if let Some(p) = producer[o.node] {
                        return Err(node_err(
                            o.node,
                            format!("cut '{}' is produced by segments {p} and {k}", c.name),
                        ));
                    }
                    producer[o.node] = Some(k);
                }
                (None, SegmentKind::Final) => {
                    if o.is_cut || o.name != CutName::final_output(o.node) {
                        return Err(node_err(o.node, format!("final output named '{}'", o.name)));
                    }
                }
                (Some(c), SegmentKind::Final) => {
                    return Err(node_err(
                        o.node,
                        format!("cut '{}' is an output of the final segment", c.name),
                    ));
                }
                (None, SegmentKind::Cut) => {
                    return Err(node_err(
                        o.node,
                        format!(
                            "is not a cut but is output '{}' of cut segment {k} '{}'",
                            o.name, s.name
                        ),
                    ));
                }
            }
        }
    }
    for (i, d) in nodes.iter().enumerate() {
        if owner[i].is_none() {
            return Err(node_err(i, "is computed by no segment".into()));
        }
        if let Some(c) = &d.cut {
            if producer[i].is_none() {
                return Err(node_err(
                    i,
                    format!("cut '{}' is the output of no segment", c.name),
                ));
            }
        }
    }

    // Dependencies.
    let mut internal = vec![0u32; n];
    let mut input_node = vec![0u32; n];
    let mut input_leaf = vec![0u32; view.leaves().len()];
    for (k, s) in plan.segments.iter().enumerate() {
        let epoch = k as u32 + 1;
        for &m in &s.internal_nodes {
            internal[m] = epoch;
        }
        for i in &s.inputs {
            match i.tensor {
                TensorRef::Leaf(l) => {
                    let Some(d) = view.leaves().get(l) else {
                        return Err(seg_err(k, format!("input leaf {l} is out of range")));
                    };
                    let want = if d.is_param {
                        InputKind::Param
                    } else {
                        InputKind::External
                    };
                    if i.kind != want {
                        return Err(GraphCutError::InvalidPlan {
                            node: view.describe(i.tensor),
                            detail: format!(
                                "is a {want:?} input but segment {k} '{}' lists it as {:?}",
                                s.name, i.kind
                            ),
                        });
                    }
                    input_leaf[l] = epoch;
                }
                TensorRef::Node(c) => {
                    if c >= n {
                        return Err(seg_err(k, format!("input node {c} is out of range")));
                    }
                    let Some(p) = producer[c] else {
                        return Err(node_err(c, format!("is an input of segment {k} '{}' but no segment produces it as a cut", s.name)));
                    };
                    if i.kind != InputKind::PreviousCut {
                        return Err(node_err(
                            c,
                            format!(
                                "is a cut but segment {k} '{}' lists it as a {:?} input",
                                s.name, i.kind
                            ),
                        ));
                    }
                    if p >= k {
                        return Err(node_err(c, format!("dependency runs backwards: segment {k} '{}' reads it, but segment {p} produces it", s.name)));
                    }
                    let name_ok = matches!(&i.cut, Some((name, from)) if Some(name) == nodes[c].cut.as_ref().map(|x| &x.name) && *from == p);
                    if !name_ok {
                        return Err(node_err(
                            c,
                            format!(
                                "input of segment {k} '{}' does not name cut {:?} of segment {p}",
                                s.name,
                                nodes[c].cut.as_ref().map(|x| x.name.to_string())
                            ),
                        ));
                    }
                    if internal[c] == epoch {
                        return Err(node_err(
                            c,
                            format!("segment {k} both computes it and reads it as a previous cut"),
                        ));
                    }
                    input_node[c] = epoch;
                }
            }
        }
        for &m in &s.internal_nodes {
            let d = &nodes[m];
            for src in d.sources() {
                match src {
                    TensorRef::Leaf(l) => {
                        if input_leaf[l] != epoch {
                            return Err(node_err(
                                m,
                                format!(
                                    "reads {} which is not an input of segment {k} '{}'",
                                    view.describe(src),
                                    s.name
                                ),
                            ));
                        }
                    }
                    TensorRef::Node(j) => {
                        if internal[j] == epoch || input_node[j] == epoch {
                            continue;
                        }
                        let detail = match producer[j].or(owner[j]) {
                            Some(p) if p >= k => format!("dependency runs backwards: reads {} of segment {p} from segment {k} '{}'", view.describe(src), s.name),
                            _ => format!("reads {} which segment {k} '{}' neither computes nor receives", view.describe(src), s.name),
                        };
                        return Err(node_err(m, detail));
                    }
                }
            }
            match d.view_src {
                Some(TensorRef::Leaf(l)) if input_leaf[l] != epoch => {
                    return Err(node_err(
                        m,
                        format!(
                            "views leaf {l} which is not an input of segment {k} '{}'",
                            s.name
                        ),
                    ));
                }
                Some(TensorRef::Node(r)) if internal[r] != epoch && input_node[r] != epoch => {
                    let carried = s.inputs.iter().any(|i| {
                        i.kind == InputKind::PreviousCut && matches!(i.tensor, TensorRef::Node(c) if nodes[c].view_src == Some(TensorRef::Node(r)))
                    });
                    if !carried {
                        return Err(node_err(m, format!("views the storage of {} which segment {k} '{}' neither computes nor receives", view.describe(TensorRef::Node(r)), s.name)));
                    }
                }
                _ => {}
            }
        }
    }

    // The plan's list of recomputations.
    let mut expected: Vec<(usize, usize, Vec<usize>)> = Vec::new();
    for (k, s) in plan.segments.iter().enumerate() {
        for &m in &s.recomputed_nodes {
            match expected.iter_mut().find(|(node, _, _)| *node == m) {
                Some(e) => e.2.push(k),
                None => expected.push((m, owner[m].unwrap_or(usize::MAX), vec![k])),
            }
        }
    }
    expected.sort();
    let listed: Vec<(usize, usize, Vec<usize>)> = plan
        .recomputations
        .iter()
        .map(|r| (r.node, r.owner, r.also_in.clone()))
        .collect();
    if listed != expected {
        let node = listed
            .iter()
            .zip(&expected)
            .find(|(a, b)| a != b)
            .map_or_else(
                || expected.first().or(listed.first()).map_or(0, |e| e.0),
                |(a, _)| a.0,
            );
        return Err(node_err(
            node.min(n.saturating_sub(1)),
            "the plan's list of recomputations does not match its segments".into(),
        ));
    }

    // Liveness.
    for (k, (s, l)) in plan
        .segments
        .iter()
        .zip(liveness::compute(&plan.segments))
        .enumerate()
    {
        if s.consumed_cuts != l.consumed || s.future_cuts != l.future || s.live_cuts != l.live {
            return Err(seg_err(
                k,
                format!(
                    "liveness differs: consumed {:?}/{:?}, future {:?}/{:?}, live {:?}/{:?} (plan/expected)",
                    names(&s.consumed_cuts),
                    names(&l.consumed),
                    names(&s.future_cuts),
                    names(&l.future),
                    names(&s.live_cuts),
                    names(&l.live)
                ),
            ));
        }
    }
    Ok(())
}

fn names(v: &[CutName]) -> Vec<String> {
    v.iter().map(|c| c.to_string()).collect()
}
