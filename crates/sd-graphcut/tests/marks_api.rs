//! The cut-mark API: misuse is an error or a diagnostic that names the mark's call site.

use sd_graphcut::{
    plan_view, CapturedGraph, CutMarks, DiagnosticKind, GraphCutError, NoMeasure, NoParams,
    PlanOptions,
};
use sd_tensor::ggml::{Context, Graph};
use sd_tensor::DType;

#[test]
fn marking_errors_name_both_call_sites() {
    let ctx = Context::new_descriptors(16, 16, 1).unwrap();
    let x = ctx.new_tensor(DType::F32, &[4]).unwrap();
    x.set_name("x");
    let a = ctx.silu(&x).unwrap();
    a.set_name("a");
    let b = ctx.tanh(&a).unwrap();
    b.set_name("b");
    let mut marks = CutMarks::new();
    let first_line = line!() + 1;
    marks.mark(&a, "blk0", "h").unwrap();

    let e = marks.mark(&a, "blk1", "h").unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, GraphCutError::DuplicateMark { .. }), "{msg}");
    assert!(
        msg.contains("'a'")
            && msg.contains(&format!("marks_api.rs:{first_line}"))
            && msg.contains(&format!("marks_api.rs:{}", first_line + 2)),
        "{msg}"
    );

    let e = marks.mark(&b, "blk0", "h").unwrap_err();
    assert!(matches!(e, GraphCutError::DuplicateCutName { .. }), "{e}");
    assert!(
        e.to_string().contains("blk0|h") && e.to_string().contains("'b'"),
        "{e}"
    );

    let e = marks.mark(&x, "blk2", "h").unwrap_err();
    assert!(matches!(e, GraphCutError::CutOnLeaf { .. }), "{e}");
    assert!(
        e.to_string().contains("'x'") && e.to_string().contains("marks_api.rs"),
        "{e}"
    );

    for (g, o) in [("a|b", "h"), ("", "h"), ("g", ""), ("<final>", "h")] {
        let e = marks.mark(&b, g, o).unwrap_err();
        assert!(matches!(e, GraphCutError::InvalidCutName { .. }), "{e}");
    }
    marks.mark_opt(None, "blk3", "h").unwrap();
    marks.mark_opt(Some(&b), "blk3", "h").unwrap();
    assert_eq!(marks.len(), 2);
    assert_eq!(marks.get(b.id()).unwrap().name.to_string(), "blk3|h");
}

#[test]
fn unconsumed_cuts_and_foreign_marks_are_reported_with_their_location() {
    // x -> a -> side (graph output)
    //        -> b -> c (graph output)
    let ctx = Context::new_descriptors(32, 32, 1).unwrap();
    let x = ctx.new_tensor(DType::F32, &[4]).unwrap();
    let a = ctx.silu(&x).unwrap();
    let side = ctx.scale(&a, 2.0).unwrap();
    let b = ctx.tanh(&a).unwrap();
    let c = ctx.relu(&b).unwrap();
    let outside = ctx.gelu(&x).unwrap();
    outside.set_name("outside");
    let mut g = Graph::new(&ctx, 32).unwrap();
    g.build_forward_expand(&side).unwrap();
    g.build_forward_expand(&c).unwrap();

    // Every cut is read later; one mark is on a tensor outside the graph.
    let mut marks = CutMarks::new();
    marks.mark(&a, "blk0", "a").unwrap();
    marks.mark(&b, "blk0", "b").unwrap();
    let line_outside = line!() + 1;
    marks.mark(&outside, "blk1", "u").unwrap();
    let cap = CapturedGraph::capture(&g, &marks, &NoParams).unwrap();
    assert_eq!(cap.diagnostics().len(), 1);
    let d = &cap.diagnostics()[0];
    assert_eq!(d.kind, DiagnosticKind::MarkNotInGraph);
    assert!(
        d.to_string().contains("'outside'")
            && d.to_string()
                .contains(&format!("marks_api.rs:{line_outside}")),
        "{d}"
    );
    let plan = plan_view(cap.view(), &PlanOptions::default(), &mut NoMeasure).unwrap();
    assert!(plan.diagnostics.is_empty(), "{:?}", plan.diagnostics);

    // 'a' is read only inside its own group: nothing later consumes it.
    let mut marks = CutMarks::new();
    let line_a = line!() + 1;
    marks.mark(&a, "blk0", "a").unwrap();
    marks.mark(&side, "blk0", "side").unwrap();
    marks.mark(&b, "blk0", "b").unwrap();
    let cap = CapturedGraph::capture(&g, &marks, &NoParams).unwrap();
    let plan = plan_view(cap.view(), &PlanOptions::default(), &mut NoMeasure).unwrap();
    assert_eq!(plan.diagnostics.len(), 1, "{:?}", plan.diagnostics);
    let d = &plan.diagnostics[0];
    assert_eq!(d.kind, DiagnosticKind::UnconsumedCut);
    assert!(
        d.to_string().contains("blk0|a")
            && d.to_string().contains(&format!("marks_api.rs:{line_a}")),
        "{d}"
    );
    let e = plan_view(
        cap.view(),
        &PlanOptions {
            warnings_as_errors: true,
        },
        &mut NoMeasure,
    )
    .unwrap_err();
    assert!(
        matches!(e, GraphCutError::Warning(_))
            && e.to_string().contains(&format!("marks_api.rs:{line_a}")),
        "{e}"
    );
}

/// Re-marking a captured graph gives what capturing it again with those marks gives: the
/// same view (fingerprint), plan and diagnostics, from any marks to any others.
#[test]
fn remarking_a_captured_graph_equals_capturing_it_again() {
    let ctx = Context::new_descriptors(32, 32, 1).unwrap();
    let x = ctx.new_tensor(DType::F32, &[4]).unwrap();
    let a = ctx.silu(&x).unwrap();
    let b = ctx.tanh(&a).unwrap();
    let c = ctx.relu(&ctx.add(&b, &a).unwrap()).unwrap();
    let outside = ctx.gelu(&x).unwrap();
    outside.set_name("outside");
    let mut g = Graph::new(&ctx, 32).unwrap();
    g.build_forward_expand(&c).unwrap();
    let mut all = CutMarks::new();
    all.mark(&a, "blk0", "a").unwrap();
    all.mark(&b, "blk1", "b").unwrap();
    let mut with_outside = CutMarks::new();
    with_outside.mark(&b, "blk1", "b").unwrap();
    with_outside.mark(&outside, "blk2", "u").unwrap();
    let sets = [CutMarks::new(), all.clone(), all.coarse(), with_outside];
    for from in &sets {
        let base = CapturedGraph::capture(&g, from, &NoParams).unwrap();
        for to in &sets {
            let fresh = CapturedGraph::capture(&g, to, &NoParams).unwrap();
            let re = base.with_marks(to).unwrap();
            assert_eq!(re.view().fingerprint(), fresh.view().fingerprint());
            assert_eq!(re.view().nodes(), fresh.view().nodes());
            assert_eq!(re.diagnostics(), fresh.diagnostics());
            let p1 = plan_view(re.view(), &PlanOptions::default(), &mut NoMeasure).unwrap();
            let p2 = plan_view(fresh.view(), &PlanOptions::default(), &mut NoMeasure).unwrap();
            assert_eq!(p1.segments.len(), p2.segments.len());
            assert_eq!(p1.fingerprint, p2.fingerprint);
        }
    }
    // Marks that differ give another fingerprint.
    let none = CapturedGraph::capture(&g, &CutMarks::new(), &NoParams).unwrap();
    assert_ne!(
        none.view().fingerprint(),
        none.with_marks(&all).unwrap().view().fingerprint()
    );
}
