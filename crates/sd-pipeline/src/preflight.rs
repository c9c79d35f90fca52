//! Preflight: every model of a generation is planned against its budget before the first
//! sampling step ([`Runtime::plan`]: the graphs are built and planned, nothing runs and no
//! device memory is held).
//!
//! - the text encoders (one chunk each), the diffusion network at the latent size and CFG batch
//!   (and the refiner's encoders and network), the VAE encoder at the init image's size
//!   (img2img) and the VAE decoder at the final size;
//! - a VAE decode (or encode) that fits at no cut granularity is switched to tiles
//!   automatically (32-latent tiles, then 16 and 8), and the switch is logged; tiles the
//!   caller chose are kept when they fit, else made smaller the same way (and logged);
//! - what fits at no granularity (nor in tiles, for the VAE) fails here, before sampling,
//!   with the engine's error naming the segment, its largest tensor and the minimum budget.
//!
//! The plans are cached by the engine, so the runs that follow do not plan again.

use sd_exec::{ExecError, PlanSummary};
use sd_models::diffusion::{DiffusionInputs, DiffusionNet};
use sd_models::text_encoder::TextEncoder;
use sd_models::HostData;
use sd_tensor::{DType, Image};

use crate::error::GenerateError;
use crate::family::ModelSpec;
use crate::params::Txt2Img;
use crate::pipeline::{runtime_err, Pipeline};
use crate::runtime::{BuiltGraph, ModelHandle, Runtime, RuntimeError};
use crate::vae_tiling::VaeTiling;

/// Tile sides tried, in latent pixels, when a whole VAE pass does not fit.
pub(crate) const AUTO_TILES: [usize; 3] = [32, 16, 8];

/// What preflight found: the plan of every model, and the VAE tiling it chose.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Preflight {
    /// `(model task, plan)` for every graph planned, in order.
    pub plans: Vec<(String, PlanSummary)>,
    /// The VAE tiling to use (the caller's, or the one chosen because the whole pass does
    /// not fit; `None`: whole).
    pub vae_tiling: Option<VaeTiling>,
    /// Whether the VAE tiling was switched on here.
    pub auto_tiled: bool,
}

impl Preflight {
    /// `params` with the VAE tiling preflight chose.
    pub fn apply(&self, params: &Txt2Img) -> Txt2Img {
        Txt2Img {
            vae_tiling: self.vae_tiling,
            ..params.clone()
        }
    }
}

fn is_budget(e: &RuntimeError) -> bool {
    matches!(e, RuntimeError::Exec(ExecError::BudgetTooSmall(_)))
}

impl Pipeline {
    /// Plans every model of generating `params` (with `init` for img2img) against the
    /// budget; returns the plans and the VAE tiling to use (see the module
    /// documentation). Errors before anything is sampled when a model fits at no
    /// granularity.
    pub fn preflight(
        &mut self,
        params: &Txt2Img,
        init: Option<&Image>,
    ) -> Result<Preflight, GenerateError> {
        let _span = tracing::info_span!("preflight", width = params.width, height = params.height)
            .entered();
        let mut out = Preflight {
            vae_tiling: params.vae_tiling,
            ..Preflight::default()
        };
        let path = self.path.clone();
        let err = |e: RuntimeError| runtime_err(&path, e);

        // Text encoders: one chunk of their maximum token count each.
        for i in 0..self.text.len() {
            let plan = self.plan_text_encoder(i).map_err(err)?;
            out.plans.push((format!("text encoder {i}"), plan));
        }

        // Diffusion network at the latent size, cond and uncond in one batch under guidance.
        let f = self.first_stage.1.downsample_factor().max(1);
        let (lw, lh) = (params.width / f, params.height / f);
        let plan = self.plan_diffusion(params).map_err(err)?;
        out.plans.push(("diffusion".into(), plan));
        // The refiner's encoders and network (it runs after the base is released).
        for (what, _, plan) in self.plan_refiner(params) {
            out.plans.push((what, plan.map_err(err)?));
        }

        // VAE: encoder at the init image's size, decoder at the final size; tiles when the
        // whole pass fits at no granularity.
        let passes: Vec<(bool, usize, usize)> = init
            .filter(|_| self.first_stage.1.has_encoder())
            .map(|i| (true, i.width() / f, i.height() / f))
            .into_iter()
            .chain([(false, lw, lh)])
            .collect();
        for (encode, w, h) in passes {
            let what = if encode { "vae encode" } else { "vae decode" };
            let (tiling, plan) = self.fit_vae(encode, w, h, out.vae_tiling).map_err(err)?;
            let switched = tiling != out.vae_tiling;
            if switched {
                let t = tiling.unwrap_or_default();
                match out.vae_tiling {
                    None => tracing::info!(
                        tile = t.tile,
                        overlap = t.overlap,
                        "{what} at {w}x{h} latents does not fit the budget: tiling it automatically"
                    ),
                    Some(asked) => tracing::info!(
                        tile = t.tile,
                        overlap = t.overlap,
                        "{what} in tiles of {} latents does not fit the budget: tiles of {} instead",
                        asked.tile,
                        t.tile
                    ),
                }
                out.vae_tiling = tiling;
                out.auto_tiled = true;
            }
            let name = match tiling {
                Some(t) if switched => format!("{what} (tiles of {})", t.tile),
                _ => what.to_string(),
            };
            out.plans.push((name, plan));
        }
        for (what, plan) in &out.plans {
            tracing::debug!(
                model = %what,
                segments = plan.segments.len(),
                fine_cuts = plan.fine_cuts,
                peak = plan.peak(),
                limit = ?plan.limit,
                "preflight plan"
            );
        }
        Ok(out)
    }

    /// The VAE pass (`encode`, `w` x `h` latents) in the tiling `asked` (`None`: whole) or,
    /// when that fits at no cut granularity, in the largest of [`AUTO_TILES`] smaller than
    /// both the asked tile and the image that does: `(tiling, plan)`. The one owner of the
    /// "tile when it does not fit" policy (preflight and `sd plan` ask here). Smaller tiles keep
    /// the asked overlap's share of the tile (half by default). When nothing fits, the error
    /// of the asked geometry (it names the minimum budget).
    pub(crate) fn fit_vae(
        &mut self,
        encode: bool,
        w: usize,
        h: usize,
        asked: Option<VaeTiling>,
    ) -> Result<(Option<VaeTiling>, PlanSummary), RuntimeError> {
        let side = |t: Option<VaeTiling>, n: usize| t.map_or(n, |t| t.tile.min(n));
        let first = match self.plan_vae(encode, side(asked, w), side(asked, h)) {
            Ok(plan) => return Ok((asked, plan)),
            Err(e) if is_budget(&e) => e,
            Err(e) => return Err(e),
        };
        let largest = asked.map_or(w.max(h), |t| t.tile.min(w.max(h)));
        for tile in AUTO_TILES.into_iter().filter(|&t| t < largest) {
            let overlap = asked.map_or(tile / 2, |a| a.overlap * tile / a.tile.max(1));
            let t = VaeTiling {
                tile,
                overlap: overlap.min(tile - 1),
            };
            match self.plan_vae(encode, tile.min(w), tile.min(h)) {
                Ok(plan) => return Ok((Some(t), plan)),
                Err(e) if is_budget(&e) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(first)
    }

    /// Plans text encoder `i` on one chunk of its maximum token count.
    pub fn plan_text_encoder(&mut self, i: usize) -> Result<PlanSummary, RuntimeError> {
        let tokens = self.spec.text_encoders[i].1.max_tokens();
        plan_text(&mut self.runtime, &self.text[i], tokens)
    }

    /// The refiner's plans (see [`Pipeline::add_refiner`](crate::pipeline::Pipeline)): each of
    /// its text encoders, then one step of its diffusion network at `params`' size, as
    /// `(task, model, plan)`; empty without a refiner.
    pub(crate) fn plan_refiner(
        &mut self,
        params: &Txt2Img,
    ) -> Vec<(String, ModelHandle, Result<PlanSummary, RuntimeError>)> {
        let f = self.first_stage.1.downsample_factor().max(1);
        let Some(r) = &self.refiner else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (i, enc) in r.text.iter().enumerate() {
            let tokens = r.spec.text_encoders[i].1.max_tokens();
            out.push((
                format!("refiner text encoder {i}"),
                enc.0,
                plan_text(&mut self.runtime, enc, tokens),
            ));
        }
        let plan = plan_step(&mut self.runtime, &r.diffusion, &r.spec, params, f);
        out.push(("refiner diffusion".into(), r.diffusion.0, plan));
        out
    }

    /// Plans one step of the diffusion network at `params`' latent size, cond and uncond in
    /// one batch when `params.cfg_scale` is not 1 (as the guidance runs it).
    pub fn plan_diffusion(&mut self, params: &Txt2Img) -> Result<PlanSummary, RuntimeError> {
        let f = self.first_stage.1.downsample_factor().max(1);
        plan_step(&mut self.runtime, &self.diffusion, &self.spec, params, f)
    }

    /// Plans a VAE encode (`encode`) or decode of `w` x `h` latent pixels against the
    /// budget (see [`Runtime::plan`](crate::runtime::Runtime::plan)).
    pub fn plan_vae(
        &mut self,
        encode: bool,
        w: usize,
        h: usize,
    ) -> Result<PlanSummary, RuntimeError> {
        let f = self.first_stage.1.downsample_factor().max(1);
        let zc = self.spec.first_stage.1.latent_channels();
        let (handle, vae) = (self.first_stage.0, &self.first_stage.1);
        let graph_size = vae.graph_size();
        let what = if encode { "vae encode" } else { "vae decode" };
        self.runtime.plan(handle, what, graph_size, |g| {
            let (ne, n) = if encode {
                ([w * f, h * f, 3, 1], w * f * h * f * 3)
            } else {
                ([w, h, zc, 1], w * h * zc)
            };
            let t = g.ctx.new_tensor(DType::F32, &ne)?;
            let output = if encode {
                vae.encode(g, &t)?
            } else {
                vae.decode(g, &t)?
            };
            Ok(BuiltGraph {
                output,
                inputs: vec![(t, HostData::F32(vec![0.0; n]))],
            })
        })
    }
}

/// Plans one step of `(handle, net)` (a model of family `spec`) at `params`' latent size
/// (`f` pixels a latent), cond and uncond in one batch when `params.cfg_scale` is not 1.
fn plan_step(
    runtime: &mut Runtime,
    (handle, net): &(ModelHandle, DiffusionNet),
    spec: &ModelSpec,
    params: &Txt2Img,
    f: usize,
) -> Result<PlanSummary, RuntimeError> {
    let (lw, lh) = (params.width / f, params.height / f);
    // Sizes from the loaded network (a DiT reads them from its tensors).
    let (c, ctx_dim, adm, guidance, tokens) = match net {
        DiffusionNet::Unet(u) => (
            u.config.in_channels,
            u.config.context_dim,
            u.config.adm_in_channels,
            false,
            spec.text_encoders.first().map_or(77, |t| t.1.max_tokens()),
        ),
        DiffusionNet::Flux(f) => (
            f.config.in_channels / 4,
            f.config.context_in_dim,
            Some(f.config.vec_in_dim),
            f.guidance_in.is_some(),
            crate::family::flux::T5_TOKENS,
        ),
        DiffusionNet::Mmdit(m) => (
            m.config.in_channels,
            m.config.context_dim,
            Some(m.config.pooled_dim),
            false,
            crate::family::sd3::CONTEXT_TOKENS,
        ),
        // The context follows the prompt; plan for the longest diffusers passes.
        DiffusionNet::QwenImage(q) => (
            q.config.in_channels / 4,
            q.config.joint_attention_dim,
            None,
            false,
            crate::family::qwen_image::MAX_PROMPT_TOKENS,
        ),
    };
    let batch = if params.cfg_scale != 1.0 { 2 } else { 1 };
    runtime.plan(*handle, "diffusion", net.graph_size(), |g| {
        let x = g.ctx.new_tensor(DType::F32, &[lw, lh, c, batch])?;
        let t = g.ctx.new_tensor(DType::F32, &[batch])?;
        let ctx = g.ctx.new_tensor(DType::F32, &[ctx_dim, tokens, batch])?;
        let y = match adm {
            Some(n) => Some(g.ctx.new_tensor(DType::F32, &[n, batch])?),
            None => None,
        };
        let gd = if guidance {
            Some(g.ctx.new_tensor(DType::F32, &[batch])?)
        } else {
            None
        };
        let mut inputs = DiffusionInputs::new(&x, &t);
        inputs.context = Some(&ctx);
        inputs.y = y.as_ref();
        inputs.guidance = gd.as_ref();
        let output = net.forward(g, &inputs)?;
        let mut data = vec![
            (x.clone(), HostData::F32(vec![0.0; lw * lh * c * batch])),
            (t.clone(), HostData::F32(vec![0.0; batch])),
            (
                ctx.clone(),
                HostData::F32(vec![0.0; ctx_dim * tokens * batch]),
            ),
        ];
        if let (Some(y), Some(n)) = (y, adm) {
            data.push((y, HostData::F32(vec![0.0; n * batch])));
        }
        if let Some(gd) = gd {
            data.push((gd, HostData::F32(vec![0.0; batch])));
        }
        Ok(BuiltGraph {
            output,
            inputs: data,
        })
    })
}

/// Plans text encoder `(handle, enc)` on one chunk of `tokens`.
fn plan_text(
    runtime: &mut Runtime,
    (handle, enc): &(ModelHandle, TextEncoder),
    tokens: usize,
) -> Result<PlanSummary, RuntimeError> {
    runtime.plan(*handle, "text encoder", enc.graph_size(), |g| {
        let input = g.ctx.new_tensor(DType::I32, &[tokens, 1])?;
        let output = enc.forward(g, &input)?;
        Ok(BuiltGraph {
            output,
            inputs: vec![(input, HostData::I32(vec![0; tokens]))],
        })
    })
}
