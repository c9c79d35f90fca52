//! Property tests of the planner over random abstract DAGs with random cut marks:
//! coverage (every node owned by exactly one segment, other computations declared as
//! recomputations), inputs produced before their segment, exact live/future cut sets,
//! equivalence of segment-by-segment evaluation with monolithic evaluation, validation, and
//! fingerprints that change exactly when the structure changes.

use std::collections::{BTreeSet, HashMap};

use proptest::prelude::*;
use sd_graphcut::{
    plan_view, validate, CutInfo, CutName, GraphView, InputKind, NoMeasure, Plan, PlanOptions,
    SegmentKind, TensorDesc, TensorRef,
};

#[derive(Clone, Debug)]
struct NodeSpec {
    op: u32,
    /// Indices into leaves ++ nodes (< n_leaves + own index).
    srcs: Vec<usize>,
    /// Make it a view of its first source's storage root.
    view: bool,
    output_flag: bool,
    bytes: usize,
}

#[derive(Clone, Debug)]
struct DagSpec {
    params: Vec<bool>,
    nodes: Vec<NodeSpec>,
    /// (node, group, output) in node order.
    cuts: Vec<(usize, usize)>,
}

fn node_spec(n_leaves: usize, i: usize) -> impl Strategy<Value = NodeSpec> {
    let pool = n_leaves + i;
    (
        1u32..7,
        prop::collection::vec(0..pool, 1..4),
        prop::bool::weighted(0.15),
        prop::bool::weighted(0.08),
        1usize..64,
    )
        .prop_map(|(op, srcs, view, output_flag, words)| NodeSpec {
            op,
            srcs,
            view,
            output_flag,
            bytes: words * 4,
        })
}

fn dag_spec() -> impl Strategy<Value = DagSpec> {
    (1usize..5, 1usize..48)
        .prop_flat_map(|(nl, nn)| {
            let nodes: Vec<_> = (0..nn).map(|i| node_spec(nl, i).boxed()).collect();
            (
                prop::collection::vec(any::<bool>(), nl),
                nodes,
                prop::collection::vec((prop::bool::weighted(0.3), 0u8..10), nn),
            )
        })
        .prop_map(|(params, nodes, cut_choice)| {
            let mut cuts = Vec::new();
            let mut group = 0usize;
            for (i, (is_cut, roll)) in cut_choice.into_iter().enumerate() {
                if !is_cut {
                    continue;
                }
                let g = match roll {
                    // Now and then go back to an earlier group (interleaved groups).
                    0 if group > 0 => group - 1,
                    1..=4 => group,
                    _ => {
                        if !cuts.is_empty() {
                            group += 1;
                        }
                        group
                    }
                };
                cuts.push((i, g));
            }
            DagSpec {
                params,
                nodes,
                cuts,
            }
        })
}

fn build_view(spec: &DagSpec, name_salt: &str) -> GraphView {
    let nl = spec.params.len();
    let leaves: Vec<TensorDesc> = spec
        .params
        .iter()
        .enumerate()
        .map(|(i, &p)| TensorDesc::leaf(&format!("{name_salt}leaf{i}"), 64, p))
        .collect();
    let mut nodes: Vec<TensorDesc> = Vec::new();
    let tref = |j: usize| {
        if j < nl {
            TensorRef::Leaf(j)
        } else {
            TensorRef::Node(j - nl)
        }
    };
    for (i, n) in spec.nodes.iter().enumerate() {
        let srcs: Vec<TensorRef> = n.srcs.iter().map(|&j| tref(j)).collect();
        let mut d = TensorDesc::node(&format!("{name_salt}n{i}"), n.op, "op", &srcs, n.bytes);
        d.ne = [n.bytes / 4, 1, 1, 1];
        d.nb = [4, n.bytes, n.bytes, n.bytes];
        if n.view {
            // View of the first source's storage root.
            let root = match srcs[0] {
                TensorRef::Node(j) => nodes[j].view_src.unwrap_or(TensorRef::Node(j)),
                leaf => leaf,
            };
            d.view_src = Some(root);
            d.view_offs = 0;
        }
        if n.output_flag {
            d.flags |= sd_graphcut::FLAG_OUTPUT;
        }
        nodes.push(d);
    }
    for &(node, group) in &spec.cuts {
        nodes[node].cut = Some(CutInfo {
            name: CutName::new(&format!("g{group}"), &format!("o{node}")).unwrap(),
            location: None,
        });
    }
    GraphView::new(leaves, nodes).expect("generated view is valid")
}

fn plan_of(view: &GraphView) -> Plan {
    plan_view(view, &PlanOptions::default(), &mut NoMeasure).expect("planning succeeds")
}

/// Independent checks of the plan's claims.
fn check_properties(view: &GraphView, plan: &Plan) -> Result<(), TestCaseError> {
    let n = view.nodes().len();
    validate(plan, view).map_err(|e| TestCaseError::fail(format!("validation: {e}")))?;

    // Coverage: exactly one owning segment per node, every other computation declared.
    let mut producer: HashMap<usize, usize> = HashMap::new();
    for i in 0..n {
        let computing: Vec<usize> = (0..plan.segments.len())
            .filter(|&k| plan.segments[k].internal_nodes.contains(&i))
            .collect();
        let owners: Vec<usize> = computing
            .iter()
            .copied()
            .filter(|&k| !plan.segments[k].recomputed_nodes.contains(&i))
            .collect();
        prop_assert_eq!(
            owners.len(),
            1,
            "node {} owners {:?} (computed by {:?})",
            i,
            owners,
            computing
        );
        if computing.len() > 1 {
            let r = plan
                .recomputations
                .iter()
                .find(|r| r.node == i)
                .expect("recomputation listed");
            prop_assert_eq!(r.owner, owners[0]);
            let mut others: Vec<usize> = computing
                .iter()
                .copied()
                .filter(|&k| k != owners[0])
                .collect();
            others.sort();
            prop_assert_eq!(&r.also_in, &others);
        } else {
            prop_assert!(!plan.recomputations.iter().any(|r| r.node == i));
        }
        if let Some(c) = &view.nodes()[i].cut {
            let k = plan
                .segments
                .iter()
                .position(|s| s.outputs.iter().any(|o| o.node == i))
                .expect("cut is an output");
            prop_assert_eq!(&plan.segments[k].name, c.name.group());
            producer.insert(i, k);
        }
    }

    // Inputs are produced before the segment, and every source is satisfied.
    for (k, s) in plan.segments.iter().enumerate() {
        let internal: BTreeSet<usize> = s.internal_nodes.iter().copied().collect();
        let mut prev_cuts: BTreeSet<usize> = BTreeSet::new();
        let mut leaves: BTreeSet<usize> = BTreeSet::new();
        for i in &s.inputs {
            match (i.kind, i.tensor) {
                (InputKind::PreviousCut, TensorRef::Node(c)) => {
                    let p = producer[&c];
                    prop_assert!(
                        p < k,
                        "segment {} reads cut node {} produced by segment {}",
                        k,
                        c,
                        p
                    );
                    prev_cuts.insert(c);
                }
                (InputKind::Param, TensorRef::Leaf(l)) => {
                    prop_assert!(view.leaves()[l].is_param);
                    leaves.insert(l);
                }
                (InputKind::External, TensorRef::Leaf(l)) => {
                    prop_assert!(!view.leaves()[l].is_param);
                    leaves.insert(l);
                }
                other => prop_assert!(false, "bad input {:?}", other),
            }
        }
        for &m in &internal {
            for src in view.nodes()[m].sources() {
                match src {
                    TensorRef::Leaf(l) => prop_assert!(leaves.contains(&l)),
                    TensorRef::Node(j) => prop_assert!(
                        internal.contains(&j) || prev_cuts.contains(&j),
                        "node {} src {} unsatisfied in segment {}",
                        m,
                        j,
                        k
                    ),
                }
            }
        }
        // No previous cut is read for nothing.
        for &c in &prev_cuts {
            let used = internal.iter().any(|&m| {
                let d = &view.nodes()[m];
                d.sources().any(|s| s == TensorRef::Node(c))
                    || d.view_src == Some(TensorRef::Node(c))
            });
            prop_assert!(
                used,
                "segment {} receives cut node {} but nothing reads it",
                k,
                c
            );
        }
        // Final segment only at the end.
        if s.kind == SegmentKind::Final {
            prop_assert_eq!(k, plan.segments.len() - 1);
        }
    }

    // Exact liveness, from the definitions.
    let readers: HashMap<usize, Vec<usize>> = {
        let mut r: HashMap<usize, Vec<usize>> = HashMap::new();
        for (k, s) in plan.segments.iter().enumerate() {
            for i in s.inputs_of(InputKind::PreviousCut) {
                if let TensorRef::Node(c) = i.tensor {
                    r.entry(c).or_default().push(k);
                }
            }
        }
        r
    };
    let name_of = |c: usize| view.nodes()[c].cut.as_ref().unwrap().name.clone();
    for (k, s) in plan.segments.iter().enumerate() {
        let consumed: BTreeSet<CutName> = readers
            .iter()
            .filter(|(_, ks)| ks.contains(&k))
            .map(|(&c, _)| name_of(c))
            .collect();
        let future: BTreeSet<CutName> = producer
            .iter()
            .filter(|(c, &p)| p <= k && readers.get(c).is_some_and(|ks| ks.iter().any(|&r| r > k)))
            .map(|(&c, _)| name_of(c))
            .collect();
        let live: BTreeSet<CutName> = consumed.union(&future).cloned().collect();
        prop_assert_eq!(
            s.consumed_cuts.iter().cloned().collect::<BTreeSet<_>>(),
            consumed
        );
        prop_assert_eq!(
            s.future_cuts.iter().cloned().collect::<BTreeSet<_>>(),
            future.clone()
        );
        prop_assert_eq!(s.live_cuts.iter().cloned().collect::<BTreeSet<_>>(), live);
        let future_bytes: usize = future
            .iter()
            .map(|c| {
                view.nodes()
                    .iter()
                    .find(|d| d.cut.as_ref().is_some_and(|x| &x.name == c))
                    .unwrap()
                    .bytes
            })
            .sum();
        prop_assert_eq!(s.bytes.future_cuts, future_bytes);
    }
    Ok(())
}

fn mix(a: u64, b: u64) -> u64 {
    let mut x = a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^ (x >> 29)
}

/// A value for every node: a hash of its op and its sources' values.
fn eval_node(
    view: &GraphView,
    i: usize,
    get: &mut dyn FnMut(TensorRef) -> Option<u64>,
) -> Option<u64> {
    let d = &view.nodes()[i];
    let mut v = mix(d.op as u64, i as u64);
    for s in d.sources() {
        v = mix(v, get(s)?);
    }
    Some(v)
}

/// Runs the plan on abstract values with a cut cache pruned to live/future sets, and
/// compares every graph output and cut with monolithic evaluation.
fn check_equivalence(view: &GraphView, plan: &Plan, seed: u64) -> Result<(), TestCaseError> {
    let leaf = |l: usize| mix(seed, 1_000_000 + l as u64);
    let mut mono: Vec<u64> = Vec::new();
    for i in 0..view.nodes().len() {
        let v = eval_node(view, i, &mut |r| match r {
            TensorRef::Leaf(l) => Some(leaf(l)),
            TensorRef::Node(j) => Some(mono[j]),
        })
        .unwrap();
        mono.push(v);
    }
    let mut cache: HashMap<CutName, u64> = HashMap::new();
    for (k, s) in plan.segments.iter().enumerate() {
        cache.retain(|n, _| s.live_cuts.contains(n) || plan.graph_outputs().any(|o| &o.name == n));
        let mut local: HashMap<usize, u64> = HashMap::new();
        for &m in &s.internal_nodes {
            let v = eval_node(view, m, &mut |r| match r {
                TensorRef::Leaf(l) => Some(leaf(l)),
                TensorRef::Node(j) => local.get(&j).copied().or_else(|| {
                    view.nodes()[j]
                        .cut
                        .as_ref()
                        .and_then(|c| cache.get(&c.name).copied())
                }),
            });
            let v = v.ok_or_else(|| {
                TestCaseError::fail(format!("segment {k}: node {m} misses a source"))
            })?;
            prop_assert_eq!(v, mono[m], "segment {} node {}", k, m);
            local.insert(m, v);
        }
        for o in &s.outputs {
            if o.graph_output || s.future_cuts.contains(&o.name) {
                cache.insert(o.name.clone(), local[&o.node]);
            }
        }
        cache
            .retain(|n, _| s.future_cuts.contains(n) || plan.graph_outputs().any(|o| &o.name == n));
    }
    for o in plan.graph_outputs() {
        prop_assert_eq!(
            cache.get(&o.name).copied(),
            Some(mono[o.node]),
            "graph output {}",
            o.name
        );
    }
    Ok(())
}

#[derive(Clone, Debug)]
enum Mutation {
    Op(usize),
    Bytes(usize),
    Src(usize, usize),
    ToggleCut(usize),
    RenameCut(usize),
    Param(usize),
    OutputFlag(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        any::<usize>().prop_map(Mutation::Op),
        any::<usize>().prop_map(Mutation::Bytes),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Mutation::Src(a, b)),
        any::<usize>().prop_map(Mutation::ToggleCut),
        any::<usize>().prop_map(Mutation::RenameCut),
        any::<usize>().prop_map(Mutation::Param),
        any::<usize>().prop_map(Mutation::OutputFlag),
    ]
}

/// Applies a mutation that changes the structure; returns false when it cannot apply.
fn mutate(spec: &mut DagSpec, m: &Mutation) -> bool {
    let nn = spec.nodes.len();
    let nl = spec.params.len();
    match *m {
        Mutation::Op(i) => spec.nodes[i % nn].op += 1,
        Mutation::Bytes(i) => spec.nodes[i % nn].bytes += 4,
        Mutation::Src(i, j) => {
            let i = i % nn;
            let pool = nl + i;
            let old = spec.nodes[i].srcs[0];
            let new = j % pool;
            if new == old {
                return false;
            }
            spec.nodes[i].srcs[0] = new;
        }
        Mutation::ToggleCut(i) => {
            let i = i % nn;
            if let Some(p) = spec.cuts.iter().position(|&(c, _)| c == i) {
                spec.cuts.remove(p);
            } else {
                let p = spec
                    .cuts
                    .iter()
                    .position(|&(c, _)| c > i)
                    .unwrap_or(spec.cuts.len());
                spec.cuts.insert(p, (i, 999));
            }
        }
        Mutation::RenameCut(i) => {
            if spec.cuts.is_empty() {
                return false;
            }
            let p = i % spec.cuts.len();
            spec.cuts[p].1 += 1000;
        }
        Mutation::Param(i) => {
            let i = i % nl;
            spec.params[i] = !spec.params[i];
        }
        Mutation::OutputFlag(i) => {
            let i = i % nn;
            spec.nodes[i].output_flag = !spec.nodes[i].output_flag;
        }
    }
    true
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn plans_cover_order_and_liveness(spec in dag_spec(), seed in any::<u64>()) {
        let view = build_view(&spec, "");
        let plan = plan_of(&view);
        check_properties(&view, &plan)?;
        check_equivalence(&view, &plan, seed)?;
        prop_assert_eq!(plan.has_cuts, !spec.cuts.is_empty());
    }

    #[test]
    fn fingerprint_changes_iff_structure_changes(spec in dag_spec(), m in mutation()) {
        let a = build_view(&spec, "");
        // Same structure, other names: same fingerprint, and the plan is reusable.
        let b = build_view(&spec, "renamed_");
        prop_assert_eq!(a.fingerprint(), b.fingerprint());
        let plan = plan_of(&a);
        prop_assert!(validate(&plan, &b).is_ok());
        // A structural change: another fingerprint, and the old plan is rejected.
        let mut changed = spec.clone();
        if mutate(&mut changed, &m) {
            let c = build_view(&changed, "");
            prop_assert_ne!(a.fingerprint(), c.fingerprint(), "mutation {:?}", m);
            prop_assert!(validate(&plan, &c).is_err());
        }
    }
}

fn chain_view() -> GraphView {
    // x -> a -> b(cut g1) -> c -> d(cut g2) -> e ; t = f(x) shared by b and d.
    let leaves = vec![
        TensorDesc::leaf("x", 16, false),
        TensorDesc::leaf("w", 16, true),
    ];
    let l = TensorRef::Leaf;
    let n = TensorRef::Node;
    let mut nodes = vec![
        TensorDesc::node("t", 1, "shared", &[l(0)], 16),
        TensorDesc::node("a", 2, "mul_mat", &[l(1), l(0)], 16),
        TensorDesc::node("b", 3, "add", &[n(1), n(0)], 16),
        TensorDesc::node("c", 2, "mul_mat", &[l(1), n(2)], 16),
        TensorDesc::node("d", 3, "add", &[n(3), n(0)], 16),
        TensorDesc::node("e", 4, "silu", &[n(4)], 16),
    ];
    nodes[2].cut = Some(CutInfo {
        name: CutName::new("g1", "b").unwrap(),
        location: None,
    });
    nodes[4].cut = Some(CutInfo {
        name: CutName::new("g2", "d").unwrap(),
        location: None,
    });
    GraphView::new(leaves, nodes).unwrap()
}

#[test]
fn shared_uncut_tensor_is_recomputed_and_declared() {
    let view = chain_view();
    let plan = plan_of(&view);
    assert_eq!(plan.segments.len(), 3);
    assert_eq!(plan.segments[0].internal_nodes, vec![0, 1, 2]);
    assert_eq!(plan.segments[1].internal_nodes, vec![0, 3, 4]);
    assert_eq!(plan.segments[1].recomputed_nodes, vec![0]);
    assert_eq!(plan.recomputations.len(), 1);
    assert_eq!(plan.recomputations[0].node, 0);
    assert_eq!(plan.recomputations[0].also_in, vec![1]);
    assert_eq!(plan.segments[2].kind, SegmentKind::Final);
    assert_eq!(plan.segments[2].internal_nodes, vec![5]);
    assert_eq!(plan.segments[1].params().collect::<Vec<_>>(), vec![1]);
    assert_eq!(
        plan.segments[1].consumed_cuts,
        vec![CutName::new("g1", "b").unwrap()]
    );
    assert_eq!(
        plan.segments[1].future_cuts,
        vec![CutName::new("g2", "d").unwrap()]
    );
    assert!(plan.segments[2].future_cuts.is_empty());
}

#[test]
fn graph_without_cuts_is_one_final_segment() {
    let leaves = vec![TensorDesc::leaf("x", 16, false)];
    let nodes = vec![
        TensorDesc::node("a", 1, "op", &[TensorRef::Leaf(0)], 16),
        TensorDesc::node("b", 1, "op", &[TensorRef::Node(0)], 16),
    ];
    let view = GraphView::new(leaves, nodes).unwrap();
    let plan = plan_of(&view);
    assert!(!plan.has_cuts);
    assert_eq!(plan.segments.len(), 1);
    assert_eq!(plan.segments[0].internal_nodes, vec![0, 1]);
}

#[test]
fn validation_rejects_broken_plans_naming_the_node() {
    let view = chain_view();
    let good = plan_of(&view);
    validate(&good, &view).unwrap();

    // A node computed by no segment.
    let mut p = good.clone();
    p.segments[2].internal_nodes.clear();
    let e = validate(&p, &view).unwrap_err().to_string();
    assert!(e.contains("node #5 'e'"), "{e}");

    // A node owned twice.
    let mut p = good.clone();
    p.segments[1].recomputed_nodes.clear();
    let e = validate(&p, &view).unwrap_err().to_string();
    assert!(
        e.contains("node #0 't'") && e.contains("owned by segments 0 and 1"),
        "{e}"
    );

    // Segments swapped: dependencies run backwards.
    let mut p = good.clone();
    p.segments.swap(0, 1);
    let e = validate(&p, &view).unwrap_err().to_string();
    assert!(e.contains("backwards") || e.contains("owned by"), "{e}");
    let mut p = good.clone();
    p.segments[1]
        .inputs
        .retain(|i| i.kind != InputKind::PreviousCut);
    p.segments[1].internal_nodes.retain(|&m| m != 2);
    let e = validate(&p, &view).unwrap_err().to_string();
    assert!(
        e.contains("node #3 'c'") && e.contains("reads node #2 'b'"),
        "{e}"
    );

    // A previous cut claimed from a later segment.
    let mut p = good.clone();
    for i in &mut p.segments[1].inputs {
        if let Some((_, from)) = &mut i.cut {
            *from = 2;
        }
    }
    assert!(validate(&p, &view).is_err());

    // Wrong liveness.
    let mut p = good.clone();
    p.segments[0].future_cuts.clear();
    let e = validate(&p, &view).unwrap_err().to_string();
    assert!(e.contains("liveness"), "{e}");

    // Another graph.
    let other = {
        let leaves = vec![TensorDesc::leaf("x", 16, false)];
        GraphView::new(
            leaves,
            vec![TensorDesc::node("a", 1, "op", &[TensorRef::Leaf(0)], 16)],
        )
        .unwrap()
    };
    assert!(matches!(
        validate(&good, &other),
        Err(sd_graphcut::GraphCutError::FingerprintMismatch { .. })
    ));
}

#[test]
fn invalid_views_are_rejected_naming_the_node() {
    let leaves = vec![TensorDesc::leaf("x", 16, false)];
    let nodes = vec![
        TensorDesc::node("a", 1, "op", &[TensorRef::Node(1)], 16),
        TensorDesc::node("b", 1, "op", &[TensorRef::Leaf(0)], 16),
    ];
    let e = GraphView::new(leaves.clone(), nodes)
        .unwrap_err()
        .to_string();
    assert!(e.contains("node #0 'a'") && e.contains("earlier"), "{e}");
    let nodes = vec![TensorDesc::node("a", 1, "op", &[TensorRef::Leaf(3)], 16)];
    assert!(GraphView::new(leaves.clone(), nodes).is_err());
    let mut bad_leaf = leaves.clone();
    bad_leaf[0].cut = Some(CutInfo {
        name: CutName::new("g", "x").unwrap(),
        location: None,
    });
    assert!(GraphView::new(bad_leaf, vec![])
        .unwrap_err()
        .to_string()
        .contains("leaf #0 'x'"));
}

#[test]
fn plan_cache_reuses_and_evicts() {
    let mut cache = sd_graphcut::PlanCache::new(2);
    let a = chain_view();
    let mut b_spec_nodes = a.nodes().to_vec();
    b_spec_nodes[5].ne[0] += 1;
    let b = GraphView::new(a.leaves().to_vec(), b_spec_nodes).unwrap();
    let mut planned = 0;
    for i in 0..10 {
        let v = if i % 2 == 0 { &a } else { &b };
        let p = cache
            .get_or_plan(v, |v| {
                planned += 1;
                Ok(plan_of(v))
            })
            .unwrap();
        assert_eq!(p.fingerprint, v.fingerprint());
    }
    assert_eq!(planned, 2, "alternating shapes must not re-plan");
    assert_eq!(cache.stats().hits, 8);
    assert_eq!(cache.stats().misses, 2);
    // A third shape evicts the least recently used.
    let mut c_nodes = a.nodes().to_vec();
    c_nodes[5].ne[0] += 2;
    let c = GraphView::new(a.leaves().to_vec(), c_nodes).unwrap();
    cache.get_or_plan(&c, |v| Ok(plan_of(v))).unwrap();
    assert_eq!(cache.len(), 2);
    assert_eq!(cache.stats().evictions, 1);
    assert!(!cache.contains(a.fingerprint()));
    assert!(cache.contains(b.fingerprint()));
}
