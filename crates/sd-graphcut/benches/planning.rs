//! Planning time for a 5,000-node graph with 60 cuts, and plan-cache hit time.
//!
//! The graph: a shared embedding (recomputed in every segment), then 60 blocks of 83 nodes
//! (27 × mul_mat → silu → add(embedding), a residual add and a skip add from two blocks
//! back), each block's output a cut, then an 18-node head: 5,000 nodes, 60 cuts, 61
//! segments. Tensors are descriptors only; nothing is allocated.
// `criterion_group!` defines public functions without docs.
#![allow(missing_docs)]

use std::collections::HashSet;
use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use sd_graphcut::{
    plan_view, CapturedGraph, CutMarks, GraphPlanner, NoMeasure, PlanCache, PlanOptions,
};
use sd_tensor::ggml::{BufferType, Context, GTensor, Graph, TensorId};
use sd_tensor::DType;

struct Big {
    _ctx: Context,
    graph: Graph,
    marks: CutMarks,
    params: HashSet<TensorId>,
}

fn big_graph() -> Big {
    let ctx = Context::new_descriptors(8192, 8192, 1).unwrap();
    let mut params = HashSet::new();
    let mut marks = CutMarks::new();
    let weight = |name: String, params: &mut HashSet<TensorId>| {
        let w = ctx.new_tensor(DType::F32, &[64, 64]).unwrap();
        w.set_name(&name);
        params.insert(w.id());
        w
    };
    let x = ctx.new_tensor(DType::F32, &[64, 8]).unwrap();
    let t = ctx.new_tensor(DType::F32, &[64, 1]).unwrap();
    let wt = weight("wt".into(), &mut params);
    let temb = ctx.silu(&ctx.mul_mat(&wt, &t).unwrap()).unwrap();
    let step = |x: &GTensor, w: &GTensor| {
        ctx.add(&ctx.silu(&ctx.mul_mat(w, x).unwrap()).unwrap(), &temb)
            .unwrap()
    };
    let mut outs: Vec<GTensor> = vec![x.clone()];
    let mut h = x;
    for b in 0..60 {
        let w = weight(format!("w{b}"), &mut params);
        let mut y = h.clone();
        for _ in 0..27 {
            y = step(&y, &w);
        }
        y = ctx.add(&y, &h).unwrap();
        let skip = &outs[outs.len().saturating_sub(2)];
        y = ctx.add(&y, skip).unwrap();
        marks.mark(&y, &format!("blk{b}"), "h").unwrap();
        outs.push(y.clone());
        h = y;
    }
    let w = weight("head".into(), &mut params);
    for _ in 0..6 {
        h = step(&h, &w);
    }
    h.set_output();
    let mut graph = Graph::new(&ctx, 8192).unwrap();
    graph.build_forward_expand(&h).unwrap();
    assert_eq!(graph.n_nodes(), 5000);
    Big {
        _ctx: ctx,
        graph,
        marks,
        params,
    }
}

fn benches(c: &mut Criterion) {
    let big = big_graph();
    let cap = CapturedGraph::capture(&big.graph, &big.marks, &big.params).unwrap();
    let buft = BufferType::cpu();
    {
        let plan = plan_view(cap.view(), &PlanOptions::default(), &mut NoMeasure).unwrap();
        assert_eq!(plan.segments.len(), 61);
    }

    c.bench_function("plan_5000_nodes_60_cuts_no_measure", |b| {
        b.iter(|| {
            black_box(plan_view(cap.view(), &PlanOptions::default(), &mut NoMeasure).unwrap())
        })
    });
    c.bench_function("plan_5000_nodes_60_cuts_gallocr_measured", |b| {
        b.iter(|| {
            let mut planner = GraphPlanner::new(buft, PlanOptions::default(), 4);
            black_box(planner.plan(&cap).unwrap())
        })
    });
    c.bench_function("capture_5000_nodes", |b| {
        b.iter(|| black_box(CapturedGraph::capture(&big.graph, &big.marks, &big.params).unwrap()))
    });

    let mut cache = PlanCache::new(4);
    cache
        .get_or_plan(cap.view(), |v| {
            plan_view(v, &PlanOptions::default(), &mut NoMeasure)
        })
        .unwrap();
    c.bench_function("cache_hit_lookup_and_validate", |b| {
        b.iter(|| black_box(cache.get(cap.view()).unwrap()))
    });

    let mut planner = GraphPlanner::new(buft, PlanOptions::default(), 4);
    planner.plan(&cap).unwrap();
    c.bench_function("cache_hit_including_capture", |b| {
        b.iter(|| {
            let again = CapturedGraph::capture(&big.graph, &big.marks, &big.params).unwrap();
            black_box(planner.plan(&again).unwrap())
        })
    });
}

criterion_group! {
    name = planning;
    config = Criterion::default().sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
    targets = benches
}
criterion_main!(planning);
