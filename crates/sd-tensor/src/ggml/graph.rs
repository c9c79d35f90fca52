//! Compute graphs with exact capacity accounting.

use std::collections::HashSet;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use ggml_sys as sys;

use super::context::Context;
use super::error::{GgmlError, Result};
use super::tensor::GTensor;

/// A ggml compute graph built in a [`Context`].
///
/// ggml aborts when a graph overflows; `Graph` tracks which tensors it holds (nodes and
/// leafs, by ggml's own rule) and refuses an expansion that would not fit.
pub struct Graph {
    ctx: Context,
    ptr: NonNull<sys::ggml_cgraph>,
    capacity: usize,
    visited: HashSet<usize>,
    n_nodes: usize,
    n_leafs: usize,
    revision: u64,
}

/// The source of [`Graph::revision`]s: one counter for the process, so that no two graphs,
/// and no two states of one graph, ever share a revision (a graph freed and another built at
/// the same address included).
static NEXT_REVISION: AtomicU64 = AtomicU64::new(1);

fn next_revision() -> u64 {
    NEXT_REVISION.fetch_add(1, Ordering::Relaxed)
}

// SAFETY: the graph lives in its context's memory; mutations need `&mut self`.
unsafe impl Send for Graph {}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph")
            .field("nodes", &self.n_nodes)
            .field("leafs", &self.n_leafs)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl Graph {
    /// A new graph with room for `capacity` nodes (and as many leafs) in `ctx`.
    pub fn new(ctx: &Context, capacity: usize) -> Result<Graph> {
        let capacity = capacity.max(1);
        let _g = ctx.lock();
        // SAFETY: pure size query.
        let need = unsafe { sys::ggml_graph_overhead_custom(capacity, false) };
        let free = ctx.free_bytes_unlocked();
        if need > free {
            return Err(GgmlError::ContextFull {
                what: "graph".into(),
                needed: need,
                available: free,
            });
        }
        // SAFETY: room checked.
        let ptr = unsafe { sys::ggml_new_graph_custom(ctx.raw(), capacity, false) };
        let ptr = NonNull::new(ptr).ok_or_else(|| GgmlError::ContextFull {
            what: "graph".into(),
            needed: need,
            available: free,
        })?;
        Ok(Graph {
            ctx: ctx.clone(),
            ptr,
            capacity,
            visited: HashSet::new(),
            n_nodes: 0,
            n_leafs: 0,
            revision: next_revision(),
        })
    }

    /// A number naming this graph as it is now: unique in the process, and new whenever
    /// the graph changes through this handle ([`build_forward_expand`](Self::build_forward_expand)).
    /// A caller that runs the same graph again (new data in its inputs, nothing else
    /// changed) can key what it derived from the graph by it.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    pub(crate) fn raw(&self) -> *mut sys::ggml_cgraph {
        self.ptr.as_ptr()
    }

    /// The context the graph lives in.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Adds `t` and everything it depends on.
    pub fn build_forward_expand(&mut self, t: &GTensor) -> Result<()> {
        // Count what ggml would add, with ggml's node/leaf rule.
        let mut new_nodes = 0usize;
        let mut new_leafs = 0usize;
        let mut stack = vec![t.raw()];
        let mut added: Vec<usize> = Vec::new();
        let mut local: HashSet<usize> = HashSet::new();
        while let Some(p) = stack.pop() {
            let key = p as usize;
            if self.visited.contains(&key) || !local.insert(key) {
                continue;
            }
            added.push(key);
            // SAFETY: p is reachable from a live tensor, so its context is alive.
            let tr = unsafe { &*p };
            for &s in tr.src.iter() {
                if !s.is_null() {
                    stack.push(s);
                }
            }
            if tr.op == sys::GGML_OP_NONE && tr.flags & sys::GGML_TENSOR_FLAG_PARAM as i32 == 0 {
                new_leafs += 1;
            } else {
                new_nodes += 1;
            }
        }
        if self.n_nodes + new_nodes > self.capacity || self.n_leafs + new_leafs > self.capacity {
            return Err(GgmlError::GraphFull {
                needed: new_nodes.max(new_leafs),
                capacity: self.capacity,
            });
        }
        let _g = self.ctx.lock();
        // SAFETY: capacity checked exactly as ggml counts.
        unsafe { sys::ggml_build_forward_expand(self.raw(), t.raw()) };
        self.visited.extend(added);
        self.n_nodes += new_nodes;
        self.n_leafs += new_leafs;
        self.revision = next_revision();
        // SAFETY: live graph.
        debug_assert_eq!(self.n_nodes, unsafe { sys::ggml_graph_n_nodes(self.raw()) }
            as usize);
        Ok(())
    }

    /// Number of op nodes.
    pub fn n_nodes(&self) -> usize {
        // SAFETY: live graph.
        unsafe { sys::ggml_graph_n_nodes(self.raw()) as usize }
    }

    /// Number of leafs (tensors without an op, parameters excluded).
    pub fn n_leafs(&self) -> usize {
        self.n_leafs
    }

    /// Node capacity.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The `i`-th node in execution order.
    pub fn node(&self, i: usize) -> Option<GTensor> {
        if i >= self.n_nodes() {
            return None;
        }
        // SAFETY: index in range.
        let p = unsafe { sys::ggml_graph_node(self.raw(), i as i32) };
        Context::resolve(p)
    }

    /// A hash of the data addresses of every node and of every node's sources: equal for
    /// two runs of the same graph when nothing it reads or writes moved in between, the
    /// condition under which ggml's CUDA backend replays the CUDA graph it captured
    /// instead of launching every kernel again.
    pub fn data_addresses_hash(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for i in 0..self.n_nodes() {
            // SAFETY: index in range; the node and its sources live as long as the graph's
            // contexts, which outlive this borrow.
            let t = unsafe { sys::ggml_graph_node(self.raw(), i as i32).as_ref() };
            let Some(t) = t else { continue };
            (t.data as usize).hash(&mut h);
            for s in t.src.iter().filter(|s| !s.is_null()) {
                // SAFETY: a non-null source of a live node.
                (unsafe { (**s).data } as usize).hash(&mut h);
            }
        }
        h.finish()
    }

    /// All nodes in execution order.
    pub fn nodes(&self) -> Vec<GTensor> {
        (0..self.n_nodes()).filter_map(|i| self.node(i)).collect()
    }

    /// The last node (the usual output).
    pub fn last_node(&self) -> Option<GTensor> {
        self.n_nodes().checked_sub(1).and_then(|i| self.node(i))
    }

    /// Finds a tensor by name among nodes and leafs.
    pub fn get_tensor(&self, name: &str) -> Option<GTensor> {
        let c = std::ffi::CString::new(name).ok()?;
        // SAFETY: live graph, NUL-terminated name.
        let p = unsafe { sys::ggml_graph_get_tensor(self.raw(), c.as_ptr()) };
        if p.is_null() {
            None
        } else {
            Context::resolve(p)
        }
    }

    /// Whether `t` is part of this graph.
    pub fn contains(&self, t: &GTensor) -> bool {
        self.visited.contains(&(t.raw() as usize))
    }

    /// Every tensor reachable in the graph whose memory a graph allocator would assign
    /// (no data yet), views included.
    pub(crate) fn unallocated_tensors(&self) -> Vec<GTensor> {
        let mut out = Vec::new();
        for &k in &self.visited {
            let p = k as *mut sys::ggml_tensor;
            // SAFETY: visited tensors are reachable from this graph's live contexts.
            let tr = unsafe { &*p };
            if tr.data.is_null() {
                if let Some(t) = Context::resolve(p) {
                    out.push(t);
                }
            }
        }
        out
    }
}

impl Context {
    pub(crate) fn free_bytes_unlocked(&self) -> usize {
        // SAFETY: live context; caller holds the lock.
        let used = unsafe { sys::ggml_used_mem(self.raw()) };
        self.mem_size().saturating_sub(used)
    }
}
