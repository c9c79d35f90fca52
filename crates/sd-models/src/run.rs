//! A minimal CPU executor for model graphs (tests and tools; the engine in `sd-exec`
//! replaces it for real runs).

use sd_tensor::ggml::{Backend, GTensor, Gallocr, Graph};

use crate::{GraphCtx, HostData, Result};

/// Builds the graph of `outputs` in `g`'s context with room for `graph_size` nodes,
/// allocates it on the CPU, writes `inputs` and `g`'s auxiliary inputs, computes on
/// `threads` threads and reads every output as f32. Parameters must already be in host
/// memory (see [`crate::load_all_to_cpu`]).
pub fn run_cpu(
    g: &GraphCtx,
    outputs: &[&GTensor],
    inputs: &[(&GTensor, HostData)],
    graph_size: usize,
    threads: usize,
) -> Result<Vec<Vec<f32>>> {
    let mut graph = Graph::new(&g.ctx, graph_size)?;
    for t in outputs {
        t.set_output();
        graph.build_forward_expand(t)?;
    }
    for (t, _) in inputs {
        t.set_input();
    }
    let backend = Backend::cpu(threads)?;
    let mut galloc = Gallocr::new(backend.buffer_type())?;
    galloc.alloc_graph(&graph)?;
    for (t, data) in inputs {
        data.write_to(t)?;
    }
    for aux in &g.aux {
        aux.data.write_to(&aux.tensor)?;
    }
    backend.compute(&graph)?;
    let mut out = Vec::with_capacity(outputs.len());
    for t in outputs {
        out.push(t.read_f32()?);
    }
    Ok(out)
}
