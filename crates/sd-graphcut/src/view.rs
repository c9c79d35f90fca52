//! An abstract description of a ggml compute graph ([`GraphView`]) that the planner works
//! on, and its capture from a real ggml [`Graph`] ([`CapturedGraph`]).
//!
//! Tensors are referred to by position ([`TensorRef`]): op nodes in execution order and
//! leaves (inputs and weights) in the order they are first referenced. Positions, not
//! addresses, make plans reusable across graph rebuilds of the same structure and let tests
//! generate graphs without ggml.

use std::collections::{HashMap, HashSet};

use rustc_hash::FxHashMap;
use std::panic::Location;

use sd_tensor::ggml::{GTensor, Graph, TensorId};

use crate::error::{ggml, GraphCutError, Result};
use crate::fingerprint::{fingerprint, Fingerprint};
use crate::marks::{CutMarks, CutName};
use crate::plan::{Diagnostic, DiagnosticKind};

/// ggml's `GGML_OP_NONE` (a leaf).
pub const OP_NONE: u32 = 0;
/// ggml's input flag.
pub const FLAG_INPUT: i32 = 1;
/// ggml's output flag.
pub const FLAG_OUTPUT: i32 = 2;
/// ggml's parameter flag.
pub const FLAG_PARAM: i32 = 4;

/// A tensor of a [`GraphView`] by position.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TensorRef {
    /// The `i`-th leaf (input or weight).
    Leaf(usize),
    /// The `i`-th op node in execution order.
    Node(usize),
}

/// A cut mark attached to a node of a [`GraphView`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CutInfo {
    /// The cut name.
    pub name: CutName,
    /// Where the mark was made, if known.
    pub location: Option<&'static Location<'static>>,
}

/// One tensor of a [`GraphView`]: what the planner, the fingerprint and the segment builder
/// need to know about it.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorDesc {
    /// The ggml tensor it describes, if captured from ggml.
    pub id: Option<TensorId>,
    /// The tensor's name (for messages; not part of the structure).
    pub name: String,
    /// ggml op code ([`OP_NONE`] for leaves).
    pub op: u32,
    /// The op's name (for messages).
    pub op_name: &'static str,
    /// ggml type code.
    pub dtype: u32,
    /// Dimensions, innermost first.
    pub ne: [usize; 4],
    /// Byte strides, innermost first.
    pub nb: [usize; 4],
    /// Op parameters.
    pub op_params: [i32; 16],
    /// ggml flags ([`FLAG_INPUT`], [`FLAG_OUTPUT`], [`FLAG_PARAM`]).
    pub flags: i32,
    /// Source slots (`None` for an empty slot before a used one).
    pub srcs: Vec<Option<TensorRef>>,
    /// The tensor whose memory this view uses, if it is a view.
    pub view_src: Option<TensorRef>,
    /// Byte offset inside `view_src`.
    pub view_offs: usize,
    /// Bytes the tensor's data spans (`ggml_nbytes`).
    pub bytes: usize,
    /// Whether this leaf is a parameter (weight) rather than an external input.
    pub is_param: bool,
    /// The cut mark on this node, if any.
    pub cut: Option<CutInfo>,
}

impl TensorDesc {
    /// A leaf (external input, or a weight when `is_param`) of `bytes` bytes.
    pub fn leaf(name: &str, bytes: usize, is_param: bool) -> TensorDesc {
        TensorDesc {
            id: None,
            name: name.to_string(),
            op: OP_NONE,
            op_name: "NONE",
            dtype: 0,
            ne: [bytes / 4, 1, 1, 1],
            nb: [4, bytes, bytes, bytes],
            op_params: [0; 16],
            flags: 0,
            srcs: Vec::new(),
            view_src: None,
            view_offs: 0,
            bytes,
            is_param,
            cut: None,
        }
    }

    /// An op node of op code `op` reading `srcs`, `bytes` bytes.
    pub fn node(
        name: &str,
        op: u32,
        op_name: &'static str,
        srcs: &[TensorRef],
        bytes: usize,
    ) -> TensorDesc {
        TensorDesc {
            op,
            op_name,
            srcs: srcs.iter().copied().map(Some).collect(),
            is_param: false,
            ..TensorDesc::leaf(name, bytes, false)
        }
    }

    /// Whether this is a leaf.
    pub fn is_leaf(&self) -> bool {
        self.op == OP_NONE
    }

    /// Whether the tensor carries ggml's output flag.
    pub fn is_output_flagged(&self) -> bool {
        self.flags & FLAG_OUTPUT != 0
    }

    /// The used source slots.
    pub fn sources(&self) -> impl Iterator<Item = TensorRef> + '_ {
        self.srcs.iter().flatten().copied()
    }
}

/// An abstract compute graph: leaves and op nodes in execution order, each node reading
/// earlier nodes and leaves (or itself, as `ggml_cast` does). Built with [`GraphView::new`] (which checks it) or captured
/// from ggml with [`CapturedGraph::capture`].
#[derive(Clone, Debug)]
pub struct GraphView {
    leaves: Vec<TensorDesc>,
    nodes: Vec<TensorDesc>,
    fingerprint: Fingerprint,
}

impl GraphView {
    /// A view of `leaves` and `nodes`. Errors, naming the tensor: a leaf with an op or
    /// sources, a node without an op, a reference to a later node or a missing tensor, a
    /// cut on a leaf, a parameter that is not a leaf, or a cut name used twice.
    pub fn new(leaves: Vec<TensorDesc>, nodes: Vec<TensorDesc>) -> Result<GraphView> {
        let bad = |r: TensorRef, d: &TensorDesc, detail: String| GraphCutError::InvalidGraph {
            node: describe_desc(r, d),
            detail,
        };
        for (i, l) in leaves.iter().enumerate() {
            let r = TensorRef::Leaf(i);
            if !l.is_leaf() || !l.srcs.is_empty() {
                return Err(bad(r, l, "a leaf has no op and no sources".into()));
            }
            if let Some(c) = &l.cut {
                return Err(bad(r, l, format!("cut '{}' on a leaf", c.name)));
            }
            match l.view_src {
                None => {}
                Some(TensorRef::Leaf(j)) if j < leaves.len() && j != i => {}
                Some(v) => {
                    return Err(bad(
                        r,
                        l,
                        format!("a leaf can only view another leaf, not {v:?}"),
                    ))
                }
            }
        }
        let mut names: HashMap<&CutName, usize> = HashMap::new();
        for (i, n) in nodes.iter().enumerate() {
            let r = TensorRef::Node(i);
            if n.is_leaf() {
                return Err(bad(r, n, "a node needs an op".into()));
            }
            if n.is_param {
                return Err(bad(r, n, "an op result cannot be a parameter".into()));
            }
            if n.srcs.len() > 10 {
                return Err(bad(
                    r,
                    n,
                    format!("{} source slots (at most 10)", n.srcs.len()),
                ));
            }
            let check = |s: TensorRef, what: &str, self_ok: bool| -> Result<()> {
                let ok = match s {
                    TensorRef::Leaf(j) => j < leaves.len(),
                    TensorRef::Node(j) => j < i || self_ok && j == i,
                };
                if ok {
                    Ok(())
                } else {
                    Err(bad(
                        r,
                        n,
                        format!("{what} {s:?} is not an earlier node or a leaf"),
                    ))
                }
            };
            for s in n.sources() {
                check(s, "source", true)?;
            }
            if let Some(v) = n.view_src {
                check(v, "view source", false)?;
            }
            if let Some(c) = &n.cut {
                if let Some(prev) = names.insert(&c.name, i) {
                    return Err(bad(
                        r,
                        n,
                        format!("cut '{}' is also on node #{prev}", c.name),
                    ));
                }
            }
        }
        let fingerprint = fingerprint(&leaves, &nodes);
        Ok(GraphView {
            leaves,
            nodes,
            fingerprint,
        })
    }

    /// The leaves.
    pub fn leaves(&self) -> &[TensorDesc] {
        &self.leaves
    }

    /// The op nodes in execution order.
    pub fn nodes(&self) -> &[TensorDesc] {
        &self.nodes
    }

    /// One tensor.
    pub fn get(&self, r: TensorRef) -> &TensorDesc {
        match r {
            TensorRef::Leaf(i) => &self.leaves[i],
            TensorRef::Node(i) => &self.nodes[i],
        }
    }

    /// The structural fingerprint (ops, types, shapes, strides, sources, flags, parameter
    /// classification and cut names; not tensor names or addresses).
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// `node #i 'name' (OP)` or `leaf #i 'name'`, for messages.
    pub fn describe(&self, r: TensorRef) -> String {
        describe_desc(r, self.get(r))
    }
}

fn describe_desc(r: TensorRef, d: &TensorDesc) -> String {
    match r {
        TensorRef::Leaf(i) => format!("leaf #{i} '{}'", d.name),
        TensorRef::Node(i) => format!("node #{i} '{}' ({})", d.name, d.op_name),
    }
}

/// Which leaves are parameters (weights). The residency layer decides; leaves with ggml's
/// PARAM flag always are.
pub trait ParamSet {
    /// Whether tensor `id` is a parameter.
    fn is_param(&self, id: TensorId) -> bool;
}

impl ParamSet for std::collections::HashSet<TensorId> {
    fn is_param(&self, id: TensorId) -> bool {
        self.contains(&id)
    }
}

impl<F: Fn(TensorId) -> bool> ParamSet for F {
    fn is_param(&self, id: TensorId) -> bool {
        self(id)
    }
}

/// No parameters besides PARAM-flagged leaves.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoParams;

impl ParamSet for NoParams {
    fn is_param(&self, _id: TensorId) -> bool {
        false
    }
}

/// A ggml graph captured for planning: its [`GraphView`] plus the ggml tensor behind every
/// position, which the segment builder uses.
#[derive(Debug)]
pub struct CapturedGraph {
    view: GraphView,
    leaves: Vec<GTensor>,
    nodes: Vec<GTensor>,
    diagnostics: Vec<Diagnostic>,
}

impl CapturedGraph {
    /// Captures `graph` with its cut `marks`; `params` says which leaves are weights.
    /// Op-less nodes (PARAM-flagged leaves, which ggml lists among nodes) become leaves.
    /// Marks whose tensor is not in the graph are reported in
    /// [`CapturedGraph::diagnostics`] (and logged).
    pub fn capture(
        graph: &Graph,
        marks: &CutMarks,
        params: &dyn ParamSet,
    ) -> Result<CapturedGraph> {
        let _span = tracing::debug_span!("capture_graph", nodes = graph.n_nodes()).entered();
        let all = graph.nodes();
        let mut index: FxHashMap<TensorId, TensorRef> = FxHashMap::default();
        index.reserve(all.len() * 2);
        // The same references by descriptor address: most sources are found here without
        // resolving a handle (a context lookup per source); the rest go through `resolve`.
        let mut by_addr: FxHashMap<usize, TensorRef> = FxHashMap::default();
        by_addr.reserve(all.len() * 2);
        let mut nodes: Vec<GTensor> = Vec::with_capacity(all.len());
        for t in &all {
            if !t.is_leaf() {
                index.insert(t.id(), TensorRef::Node(nodes.len()));
                by_addr.insert(t.addr(), TensorRef::Node(nodes.len()));
                nodes.push(t.clone());
            }
        }
        let mut leaves: Vec<GTensor> = Vec::new();
        let mut leaf_descs: Vec<TensorDesc> = Vec::new();
        let mut node_descs: Vec<TensorDesc> = Vec::with_capacity(nodes.len());
        let mut found_marks = 0usize;
        for (i, t) in nodes.iter().enumerate() {
            let here = || format!("node #{i} '{}' ({})", t.name(), t.op_name());
            let addrs = t.source_addrs();
            let srcs: Vec<Option<TensorRef>> =
                match addrs.iter().map(|&a| known(&by_addr, a)).collect() {
                    Some(srcs) => srcs,
                    None => {
                        let slots = t.source_slots().map_err(ggml(here()))?;
                        let mut srcs = Vec::with_capacity(slots.len());
                        for s in slots {
                            srcs.push(match s {
                                None => None,
                                Some(s) => {
                                    let r = resolve(
                                        &s,
                                        &mut index,
                                        &mut leaves,
                                        &mut leaf_descs,
                                        params,
                                        &here,
                                    )?;
                                    by_addr.insert(s.addr(), r);
                                    Some(r)
                                }
                            });
                        }
                        srcs
                    }
                };
            let va = t.view_source_addr();
            let view_src = match known(&by_addr, va) {
                Some(r) => r,
                None => match t.view_source().map_err(ggml(here()))? {
                    None => None,
                    Some(v) => {
                        let r =
                            resolve(&v, &mut index, &mut leaves, &mut leaf_descs, params, &here)?;
                        by_addr.insert(v.addr(), r);
                        Some(r)
                    }
                },
            };
            let mut d = describe_tensor(t, srcs, view_src, false);
            if let Some(m) = d.id.and_then(|id| marks.get(id)) {
                found_marks += 1;
                d.cut = Some(CutInfo {
                    name: m.name.clone(),
                    location: Some(m.location),
                });
            }
            node_descs.push(d);
        }
        let mut diagnostics = Vec::new();
        if found_marks < marks.len() {
            for m in marks.iter() {
                if !matches!(index.get(&m.tensor), Some(TensorRef::Node(_))) {
                    let d = Diagnostic {
                        kind: DiagnosticKind::MarkNotInGraph,
                        message: format!(
                            "cut '{}' on tensor '{}' is not part of the graph",
                            m.name, m.tensor_name
                        ),
                        location: Some(m.location),
                    };
                    tracing::warn!(at = %m.location, "{}", d.message);
                    diagnostics.push(d);
                }
            }
        }
        let view = GraphView::new(leaf_descs, node_descs)?;
        Ok(CapturedGraph {
            view,
            leaves,
            nodes,
            diagnostics,
        })
    }

    /// The same graph with other cut `marks`, without walking the ggml graph again: what
    /// [`CapturedGraph::capture`] of the same graph with `marks` gives (same view, same
    /// fingerprint, same diagnostics), at the cost of copying the descriptions.
    pub fn with_marks(&self, marks: &CutMarks) -> Result<CapturedGraph> {
        let _span = tracing::debug_span!(
            "remark_graph",
            nodes = self.nodes.len(),
            marks = marks.len()
        )
        .entered();
        let mut node_descs: Vec<TensorDesc> = self.view.nodes.clone();
        let mut found_marks = 0usize;
        for (d, t) in node_descs.iter_mut().zip(&self.nodes) {
            d.cut = marks.get(t.id()).map(|m| {
                found_marks += 1;
                CutInfo {
                    name: m.name.clone(),
                    location: Some(m.location),
                }
            });
        }
        let mut diagnostics = Vec::new();
        if found_marks < marks.len() {
            let ids: HashSet<TensorId> = self.nodes.iter().map(|t| t.id()).collect();
            for m in marks.iter() {
                if !ids.contains(&m.tensor) {
                    let d = Diagnostic {
                        kind: DiagnosticKind::MarkNotInGraph,
                        message: format!(
                            "cut '{}' on tensor '{}' is not part of the graph",
                            m.name, m.tensor_name
                        ),
                        location: Some(m.location),
                    };
                    tracing::warn!(at = %m.location, "{}", d.message);
                    diagnostics.push(d);
                }
            }
        }
        let view = GraphView::new(self.view.leaves.clone(), node_descs)?;
        Ok(CapturedGraph {
            view,
            leaves: self.leaves.clone(),
            nodes: self.nodes.clone(),
            diagnostics,
        })
    }

    /// The abstract view.
    pub fn view(&self) -> &GraphView {
        &self.view
    }

    /// The ggml tensor at a position.
    pub fn tensor(&self, r: TensorRef) -> &GTensor {
        match r {
            TensorRef::Leaf(i) => &self.leaves[i],
            TensorRef::Node(i) => &self.nodes[i],
        }
    }

    /// The ggml leaves, by leaf position.
    pub fn leaf_tensors(&self) -> &[GTensor] {
        &self.leaves
    }

    /// The ggml op nodes, by node position.
    pub fn node_tensors(&self) -> &[GTensor] {
        &self.nodes
    }

    /// Problems with the marks found while capturing (marks on tensors outside the graph).
    pub fn diagnostics(&self) -> &[Diagnostic] {
        &self.diagnostics
    }
}

/// A source by descriptor address: `Some(None)` for an empty slot (address 0),
/// `Some(Some(r))` when the address is known, `None` when it must be resolved.
fn known(by_addr: &FxHashMap<usize, TensorRef>, a: usize) -> Option<Option<TensorRef>> {
    if a == 0 {
        Some(None)
    } else {
        by_addr.get(&a).map(|r| Some(*r))
    }
}

fn resolve(
    t: &GTensor,
    index: &mut FxHashMap<TensorId, TensorRef>,
    leaves: &mut Vec<GTensor>,
    descs: &mut Vec<TensorDesc>,
    params: &dyn ParamSet,
    here: &dyn Fn() -> String,
) -> Result<TensorRef> {
    if let Some(&r) = index.get(&t.id()) {
        return Ok(r);
    }
    if !t.is_leaf() {
        return Err(GraphCutError::InvalidGraph {
            node: here(),
            detail: format!(
                "reads '{}' ({}), an op result that is not a node of the graph",
                t.name(),
                t.op_name()
            ),
        });
    }
    // A leaf that views another leaf: capture the viewed leaf first.
    let view_src = match t.view_source().map_err(ggml(here()))? {
        None => None,
        Some(v) => Some(resolve(&v, index, leaves, descs, params, here)?),
    };
    let root_param = match view_src {
        Some(TensorRef::Leaf(j)) => descs[j].is_param,
        _ => false,
    };
    let is_param = root_param || params.is_param(t.id()) || t.flags() & FLAG_PARAM != 0;
    let r = TensorRef::Leaf(leaves.len());
    index.insert(t.id(), r);
    leaves.push(t.clone());
    descs.push(describe_tensor(t, Vec::new(), view_src, is_param));
    Ok(r)
}

fn describe_tensor(
    t: &GTensor,
    srcs: Vec<Option<TensorRef>>,
    view_src: Option<TensorRef>,
    is_param: bool,
) -> TensorDesc {
    let mut op_params = [0i32; 16];
    let p = t.op_params();
    let n = p.len().min(16);
    op_params[..n].copy_from_slice(&p[..n]);
    TensorDesc {
        id: Some(t.id()),
        name: t.name(),
        op: t.op_code(),
        op_name: t.op_name(),
        dtype: t.type_code(),
        ne: t.ne(),
        nb: t.nb(),
        op_params,
        flags: t.flags(),
        srcs,
        view_src,
        view_offs: t.view_offs(),
        bytes: t.nbytes(),
        is_param,
        cut: None,
    }
}
