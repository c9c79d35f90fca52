//! Classifier-free guidance over any diffusion network: [`Guided`] runs the network on the
//! batch `[uncond, cond]` (context and `y` stacked the same way; two runs when the two
//! contexts differ in length, as Qwen-Image's unpadded ones do) and returns
//! `uncond + scale * (cond - uncond)`, rescaled per packed token to the norm of the prompt's
//! prediction where the family asks for it (`QwenImagePipeline`'s true CFG); with scale 1 it
//! runs on the prompt alone.

use sd_models::diffusion::{DiffusionInputs, DiffusionNet};
use sd_models::{HostData, ModelError};
use sd_tensor::{DType, Tensor};

use crate::family::{Conditioning, TextCond};
use crate::params::SkipLayerGuidance;
use crate::runtime::{BuiltGraph, GraphKey, KeyedGraph, ModelHandle, Runtime, RuntimeError};
use crate::sampling::{Denoise, SamplingError};

/// The diffusion network of a runtime with classifier-free guidance (a [`Denoise`] model).
pub struct Guided<'a> {
    /// The runtime the network runs in.
    pub runtime: &'a mut Runtime,
    /// The network's handle in the runtime.
    pub handle: ModelHandle,
    /// The network.
    pub net: &'a DiffusionNet,
    /// Prompt and negative prompt.
    pub cond: &'a Conditioning,
    /// The guidance scale (1: the prompt only, one evaluation per step).
    pub cfg_scale: f32,
    /// A distilled guidance strength the network embeds (FLUX.1-dev), for every sequence of
    /// the batch; `None` for networks without one.
    pub guidance: Option<f32>,
    /// Skip-layer guidance: its scale and blocks, and the sigmas of the steps that get it.
    pub slg: Option<SlgSteps<'a>>,
    /// Rescale the guided prediction, per patch of `n x n` latent pixels (all channels), to
    /// the norm of the prompt's prediction ([`crate::family::Family::cfg_renorm`]).
    pub renorm: Option<usize>,
    /// The network's text embeddings of this run's prompts, computed at their first use.
    pub embedded: EmbeddedText,
}

/// The text embeddings ([`DiffusionNet::embed_text`]) of one sampling run: a transformer's
/// text stream input depends on the prompt alone, so it is computed once per prompt (or
/// batch of prompts) and fed to every step as a constant input, which the runtime may keep
/// on the device ([`Runtime::keep_constants`], stable-diffusion.cpp's Qwen-Image prefix
/// cache).
#[derive(Debug)]
pub struct EmbeddedText {
    /// Per batch of prompts (their addresses): the embedding `[hidden, tokens, batch]`.
    done: Vec<(Vec<usize>, [usize; 3], Vec<f32>)>,
    /// Unique in the process: the step graphs kept under an embedding's index
    /// ([`Runtime::run_keyed`]) are keyed by it too, so that no later run finds one that
    /// holds another run's embedding.
    serial: u64,
}

impl Default for EmbeddedText {
    fn default() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        EmbeddedText {
            done: Vec::new(),
            serial: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }
}

impl EmbeddedText {
    /// Embeddings computed so far.
    pub fn len(&self) -> usize {
        self.done.len()
    }

    /// Whether none is computed yet.
    pub fn is_empty(&self) -> bool {
        self.done.is_empty()
    }
}

/// `comb` rescaled, per patch of `p x p` pixels of `[C, h, w]` (all channels), to the norm of
/// `cond` over the same values (diffusers' `QwenImagePipeline` on its packed tokens).
fn renormalize(comb: &mut [f32], cond: &[f32], shape: &[usize], p: usize) {
    let (c, h, w) = (shape[1], shape[2], shape[3]);
    let p = p.max(1);
    for r0 in (0..h).step_by(p) {
        for c0 in (0..w).step_by(p) {
            let idx = |ch: usize, y: usize, x: usize| (ch * h + y) * w + x;
            let cells = || {
                (0..c).flat_map(move |ch| {
                    (r0..(r0 + p).min(h))
                        .flat_map(move |y| (c0..(c0 + p).min(w)).map(move |x| idx(ch, y, x)))
                })
            };
            let norm = |v: &[f32]| cells().map(|i| (v[i] as f64).powi(2)).sum::<f64>().sqrt();
            let (nc, nm) = (norm(cond), norm(comb));
            if nm > 0.0 {
                let s = (nc / nm) as f32;
                for i in cells() {
                    comb[i] *= s;
                }
            }
        }
    }
}

/// Where skip-layer guidance applies in one sampling run.
#[derive(Clone, Debug)]
pub struct SlgSteps<'a> {
    /// The settings.
    pub slg: &'a SkipLayerGuidance,
    /// The sigmas of the steps that get the extra pass.
    pub sigmas: Vec<f32>,
}

/// `[context, hidden]` rows of each part, concatenated (a batch along the outer axis).
fn stack<'t>(parts: impl Iterator<Item = &'t Tensor<f32>>) -> Vec<f32> {
    parts.flat_map(|t| t.data().iter().copied()).collect()
}

impl Guided<'_> {
    /// Runs the network on `x_in` (`[1, C, h, w]`) at `timestep` for the parts in `conds`,
    /// without the blocks in `skip`.
    fn run(
        &mut self,
        x_in: &Tensor<f32>,
        timestep: f32,
        conds: &[&TextCond],
        skip: &[usize],
    ) -> Result<Vec<f32>, RuntimeError> {
        let batch = conds.len();
        let shape = x_in.shape();
        let (c, h, w) = (shape[1], shape[2], shape[3]);
        let ctx_shape = conds[0].context.shape().to_vec();
        if conds
            .iter()
            .any(|t| t.context.shape() != ctx_shape.as_slice())
        {
            return Err(ModelError::Input {
                name: "context",
                detail: "prompt and negative prompt contexts differ in shape".into(),
            }
            .into());
        }
        let (tokens, hidden) = (
            ctx_shape[ctx_shape.len() - 2],
            ctx_shape[ctx_shape.len() - 1],
        );
        let xs: Vec<f32> = std::iter::repeat_n(x_in.data(), batch)
            .flatten()
            .copied()
            .collect();
        let context = stack(conds.iter().map(|t| &t.context));
        let y = match conds[0].y.as_ref() {
            Some(y0) => {
                let ys: Option<Vec<&Tensor<f32>>> = conds.iter().map(|t| t.y.as_ref()).collect();
                let ys = ys.ok_or_else(|| ModelError::Input {
                    name: "y",
                    detail: "given for one prompt but not the other".into(),
                })?;
                Some((y0.data().len(), stack(ys.into_iter())))
            }
            None => None,
        };
        let net = self.net;
        let guidance = self.guidance;
        let embedded = if net.has_text_embedding() {
            Some(self.embedding(conds, &context, [hidden, tokens, batch])?)
        } else {
            None
        };
        let embedded_run = embedded.is_some();
        // The graph's structure: kept from step to step (the data below fed to it).
        let key = GraphKey::of(&(
            [w, h, c, batch, hidden, tokens],
            y.as_ref().map(|(adm, _)| *adm),
            guidance.is_some(),
            embedded
                .as_ref()
                .map(|(index, ne, _)| (self.embedded.serial, *index, *ne)),
            skip,
        ));
        let mut data = vec![HostData::F32(xs), HostData::F32(vec![timestep; batch])];
        if !embedded_run {
            data.push(HostData::F32(context));
        }
        if let Some((_, yd)) = y.as_ref() {
            data.push(HostData::F32(yd.clone()));
        }
        if let Some(v) = guidance {
            data.push(HostData::F32(vec![v; batch]));
        }
        let out =
            self.runtime
                .run_keyed(self.handle, "diffusion", net.graph_size(), key, data, |g| {
                    let x = g.ctx.new_tensor(DType::F32, &[w, h, c, batch])?;
                    let t = g.ctx.new_tensor(DType::F32, &[batch])?;
                    let ctx = match embedded {
                        Some((index, ne, data)) => g.constant_input(
                            &format!("embedded_text.{index}"),
                            DType::F32,
                            &ne,
                            HostData::F32(data),
                        )?,
                        None => g.ctx.new_tensor(DType::F32, &[hidden, tokens, batch])?,
                    };
                    let yt = match &y {
                        Some((adm, _)) => Some(g.ctx.new_tensor(DType::F32, &[*adm, batch])?),
                        None => None,
                    };
                    let gt = match guidance {
                        Some(_) => Some(g.ctx.new_tensor(DType::F32, &[batch])?),
                        None => None,
                    };
                    let mut inputs = DiffusionInputs::new(&x, &t);
                    inputs.context = Some(&ctx);
                    inputs.context_embedded = embedded_run;
                    inputs.y = yt.as_ref();
                    inputs.guidance = gt.as_ref();
                    inputs.skip_blocks = skip;
                    let output = net.forward(g, &inputs)?;
                    // In the order of the data above.
                    let mut fed = vec![x.clone(), t.clone()];
                    if !embedded_run {
                        fed.push(ctx.clone());
                    }
                    fed.extend(yt);
                    fed.extend(gt);
                    Ok(KeyedGraph {
                        output,
                        inputs: fed,
                    })
                })?;
        Ok(out.data)
    }
}

impl Guided<'_> {
    /// The network's embedding of the stacked `context` `ne` of the prompts `conds`:
    /// computed by a graph of its own at the first use, then taken from
    /// [`Guided::embedded`]. Returns its index there, shape and values.
    fn embedding(
        &mut self,
        conds: &[&TextCond],
        context: &[f32],
        ne: [usize; 3],
    ) -> Result<(usize, [usize; 3], Vec<f32>), RuntimeError> {
        let key: Vec<usize> = conds
            .iter()
            .map(|c| *c as *const TextCond as usize)
            .collect();
        if let Some(i) = self.embedded.done.iter().position(|(k, _, _)| *k == key) {
            let (_, ne, data) = &self.embedded.done[i];
            return Ok((i, *ne, data.clone()));
        }
        let net = self.net;
        let _span = tracing::debug_span!("embed_text", tokens = ne[1], batch = ne[2]).entered();
        let out = self
            .runtime
            .run(self.handle, "text embedding", net.graph_size(), |g| {
                let states = g.ctx.new_tensor(DType::F32, &ne)?;
                let output = net
                    .embed_text(g, &states)?
                    .ok_or_else(|| ModelError::Input {
                        name: "context",
                        detail: "the network has no text embedding".into(),
                    })?;
                Ok(BuiltGraph {
                    output,
                    inputs: vec![(states, HostData::F32(context.to_vec()))],
                })
            })?;
        let shape = [out.ne[0], out.ne[1], out.ne[2]];
        self.embedded.done.push((key, shape, out.data.clone()));
        Ok((self.embedded.done.len() - 1, shape, out.data))
    }
}

impl Denoise for Guided<'_> {
    fn predict(
        &mut self,
        x_in: &Tensor<f32>,
        sigma: f32,
        timestep: f32,
    ) -> Result<Tensor<f32>, SamplingError> {
        let guided = self.cfg_scale != 1.0;
        let cond = self.cond;
        let parts: Vec<&TextCond> = if guided {
            vec![&cond.uncond, &cond.cond]
        } else {
            vec![&cond.cond]
        };
        let model = |e| SamplingError::Model(Box::new(e));
        let out = if guided && cond.uncond.context.shape() != cond.cond.context.shape() {
            // Contexts of different lengths (unpadded, no mask): one run each.
            let mut out = self
                .run(x_in, timestep, &[&cond.uncond], &[])
                .map_err(model)?;
            out.extend(
                self.run(x_in, timestep, &[&cond.cond], &[])
                    .map_err(model)?,
            );
            out
        } else {
            self.run(x_in, timestep, &parts, &[]).map_err(model)?
        };
        let n = x_in.data().len();
        if out.len() != parts.len() * n {
            return Err(SamplingError::ModelShape {
                expected: x_in.shape().to_vec(),
                got: vec![out.len()],
            });
        }
        let data = if guided {
            let (uncond, cond) = out.split_at(n);
            let mut comb: Vec<f32> = uncond
                .iter()
                .zip(cond)
                .map(|(&u, &c)| u + self.cfg_scale * (c - u))
                .collect();
            if let Some(p) = self.renorm {
                renormalize(&mut comb, cond, x_in.shape(), p);
            }
            comb
        } else {
            out.clone()
        };
        let data = match &self.slg {
            Some(s) if s.sigmas.contains(&sigma) => {
                // The prompt's prediction moves away from the one without the blocks.
                let (scale, layers) = (s.slg.scale, s.slg.layers.clone());
                let skipped = self
                    .run(x_in, timestep, &[&cond.cond], &layers)
                    .map_err(model)?;
                let text = &out[out.len() - n..];
                data.iter()
                    .zip(text.iter().zip(&skipped))
                    .map(|(&d, (&c, &k))| d + scale * (c - k))
                    .collect()
            }
            _ => data,
        };
        let count = crate::error::non_finite(&data);
        if count > 0 {
            return Err(SamplingError::NonFinite {
                model: "diffusion network",
                sigma,
                count,
            });
        }
        Ok(Tensor::new(x_in.shape().to_vec(), data)?)
    }
}

#[cfg(test)]
mod tests {
    use super::renormalize;

    /// Each 2x2 patch (both channels) of the guided prediction takes the prompt's norm; a
    /// patch whose guided values are 0 stays 0.
    #[test]
    fn renormalize_rescales_each_patch_to_the_prompt_norm() {
        // [1, 2, 2, 4]: two patches side by side.
        let cond: Vec<f32> = (0..16).map(|i| i as f32 - 5.0).collect();
        let mut comb: Vec<f32> = (0..16).map(|i| 2.0 * (i as f32) + 1.0).collect();
        for i in [2, 3, 6, 7, 10, 11, 14, 15] {
            comb[i] = 0.0;
        }
        let before = comb.clone();
        renormalize(&mut comb, &cond, &[1, 2, 2, 4], 2);
        let left = [0, 1, 4, 5, 8, 9, 12, 13];
        let norm = |v: &[f32]| {
            left.iter()
                .map(|&i| (v[i] as f64).powi(2))
                .sum::<f64>()
                .sqrt()
        };
        assert!((norm(&comb) - norm(&cond)).abs() < 1e-4);
        let ratio = comb[0] / before[0];
        for &i in &left {
            assert!((comb[i] / before[i] - ratio).abs() < 1e-6);
        }
        for i in [2, 3, 6, 7, 10, 11, 14, 15] {
            assert_eq!(comb[i], 0.0);
        }
    }
}
