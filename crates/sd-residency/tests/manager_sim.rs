//! `ModelManager` on a simulated discrete device (`SimDevice`): prepare under a budget,
//! evict, reload, bytes identical to the file; demotion; `Disk` mode frees its buffers;
//! prefetch; allocation failures leave nothing half-loaded; the budget is never exceeded
//! (asserted on the device's own high-water mark).

#[path = "common/manager.rs"]
mod support;

use std::sync::Arc;

use sd_formats::files::TensorCatalog;
use sd_residency::{
    BackendId, BackendMemoryRequest, Component, DeviceResidencyManager, ModelManager, OwnerId,
    ParamId, ParamSpec, ResidencyMode, SourceId, WeightPrefetchResult,
};
use sd_tensor::ggml::{Backend, Context, SimDevice, SimOptions};
use support::*;

/// Eight f32 `[4, 16]` tensors (256 bytes each).
fn model() -> (std::path::PathBuf, Vec<FileTensor>) {
    let tensors: Vec<FileTensor> = (0..8)
        .map(|i| {
            f32_tensor(
                &format!("model.diffusion_model.w{i}.weight"),
                &[4, 16],
                i as f32 * 100.0,
            )
        })
        .collect();
    let path = temp_path("sim");
    write_safetensors(&path, &tensors);
    (path, tensors)
}

struct Rig {
    sim: SimDevice,
    mm: ModelManager,
    cpu: BackendId,
    gpu: BackendId,
    tensors: Vec<FileTensor>,
    _ctx: Context,
    ids: Vec<ParamId>,
}

/// A manager with a CPU and a simulated backend (no reserve, 512-byte device chunks: two
/// tensors per block), the model registered with `mode`, params on `params_on_gpu ? SIM :
/// CPU`, computed on the SIM device.
fn rig(
    name: &str,
    total: u64,
    budget: Option<u64>,
    mode: ResidencyMode,
    params_on_gpu: bool,
) -> Rig {
    let sim = SimDevice::new(name, total, SimOptions::default()).unwrap();
    let (path, tensors) = model();
    let mut loader = TensorCatalog::new();
    loader.add_file(&path, None).unwrap();
    let mut mm = ModelManager::new(loader);
    mm.set_device_reserve(0);
    mm.set_max_block_bytes(512);
    mm.set_load_threads(2);
    let cpu = mm.add_backend(Arc::new(Backend::cpu(1).unwrap())).unwrap();
    let gpu = mm.add_backend(Arc::new(sim.backend().unwrap())).unwrap();
    mm.set_device_budget(&sim.device(), budget);
    let ctx = ctx(16);
    let descs = descs_for(&ctx, &tensors);
    let ids = mm
        .register_params(
            ParamSpec {
                component: Component::Diffusion,
                mode,
                params_backend: if params_on_gpu { gpu } else { cpu },
                compute_backend: gpu,
                source: SourceId::MAIN,
            },
            &descs,
        )
        .unwrap();
    Rig {
        sim,
        mm,
        cpu,
        gpu,
        tensors,
        _ctx: ctx,
        ids,
    }
}

/// Makes room for `request` with the manager's eviction primitives (the engine's policy,
/// `sd-exec`'s `ensure_capacity`, owns the ranking; this is the order it uses for weights:
/// the `preferred` groups first, then least recently used, demotions last), never evicting
/// `required` or `protected` parameters. Returns whether it fits in the end.
trait MakeRoom {
    fn make_room_for(
        &mut self,
        request: &BackendMemoryRequest,
        required: &[ParamId],
        preferred: &[Vec<ParamId>],
        protected: &[ParamId],
    ) -> Result<bool, sd_residency::ResidencyError>;
}

impl MakeRoom for ModelManager {
    fn make_room_for(
        &mut self,
        request: &BackendMemoryRequest,
        required: &[ParamId],
        preferred: &[Vec<ParamId>],
        protected: &[ParamId],
    ) -> Result<bool, sd_residency::ResidencyError> {
        if self
            .inspect_compute_backend_capacity(request, required)?
            .fits(false)
        {
            return Ok(true);
        }
        let keep: Vec<ParamId> = required.iter().chain(protected).copied().collect();
        loop {
            let rank = |b: &sd_residency::WeightResidencyBlock| {
                let pref = preferred
                    .iter()
                    .position(|g| g.iter().any(|p| b.params.contains(p)))
                    .unwrap_or(preferred.len());
                (b.requires_demotion, pref, b.last_use_epoch, b.id)
            };
            let candidates = self.evictable_compute_backend_blocks(request.backend, &keep);
            let Some(best) = candidates.iter().min_by_key(|b| rank(b)).cloned() else {
                break;
            };
            if !self.evict_compute_backend_block(&best) {
                break;
            }
            if self
                .inspect_compute_backend_capacity(request, required)?
                .fits(true)
            {
                return Ok(true);
            }
        }
        Ok(self
            .inspect_compute_backend_capacity(request, required)?
            .fits(true))
    }
}

impl Rig {
    fn req(&self) -> BackendMemoryRequest {
        BackendMemoryRequest::new(self.gpu, OwnerId(1))
    }

    /// The registered tensors of `ids` live on the device and hold the file's bytes.
    fn assert_on_device_identical(&self, ids: &[ParamId]) {
        for p in ids {
            let t = self.mm.tensor(*p).unwrap();
            assert!(self.sim.owns_tensor(t), "{p} is not on the device");
            let i = self.ids.iter().position(|x| x == p).unwrap();
            assert_eq!(
                t.read_bytes().unwrap(),
                self.tensors[i].bytes,
                "{p} differs from the file"
            );
        }
    }

    /// Ensure capacity for `ids`, prepare them, check them, unpin.
    fn run(&mut self, ids: &[ParamId], preferred: &[Vec<ParamId>]) {
        let req = self.req();
        assert!(self.mm.make_room_for(&req, ids, preferred, &[]).unwrap());
        self.mm.prepare_params(ids).unwrap();
        self.assert_on_device_identical(ids);
        self.mm.unpin_params(ids).unwrap();
    }
}

#[test]
fn staged_weights_evict_and_reload_identically_under_budget() {
    const BUDGET: u64 = 1024;
    let mut r = rig(
        "SIM_STAGE",
        1 << 20,
        Some(BUDGET),
        ResidencyMode::ParamBackend,
        false,
    );
    let (a, b) = (r.ids[..4].to_vec(), r.ids[4..].to_vec());

    r.run(&a, &[]);
    assert_eq!(r.mm.resident_bytes(&r.sim.device()), 1024);
    assert!(a.iter().all(|p| r.mm.param_info(*p).unwrap().staged));

    // B needs all of the budget: A's staging copies go.
    r.run(&b, std::slice::from_ref(&a));
    assert!(a.iter().all(|p| !r.mm.param_info(*p).unwrap().staged));
    assert!(a.iter().all(|p| !r.mm.tensor(*p).unwrap().is_allocated()));
    // Params copies on the CPU stay (ParamBackend).
    assert!(a.iter().all(|p| r.mm.param_info(*p).unwrap().loaded));

    // And back: A is restaged from its params copies, bytes identical.
    r.run(&a, &[]);
    assert!(
        r.sim.peak_bytes() <= BUDGET,
        "peak {} > budget",
        r.sim.peak_bytes()
    );
    assert_eq!(r.sim.stats().faults, 0);

    // Protected or pinned weights are not evicted: B cannot be made to fit.
    let req = r.req();
    assert!(!r.mm.make_room_for(&req, &b, &[], &a).unwrap());
    assert!(a.iter().all(|p| r.mm.param_info(*p).unwrap().staged));
    r.mm.pin_params(&a).unwrap();
    assert!(!r.mm.make_room_for(&req, &b, &[], &[]).unwrap());
    assert!(r.mm.evictable_compute_backend_blocks(r.gpu, &[]).is_empty());
    r.mm.unpin_params(&a).unwrap();
    assert_eq!(r.mm.evictable_compute_backend_blocks(r.gpu, &[]).len(), 2);
    assert!(r.sim.peak_bytes() <= BUDGET);
}

#[test]
fn other_owners_runtime_residency_counts_against_the_budget() {
    const BUDGET: u64 = 2048;
    let mut r = rig(
        "SIM_OWNERS",
        1 << 20,
        Some(BUDGET),
        ResidencyMode::ParamBackend,
        false,
    );
    let a = r.ids[..4].to_vec();
    let req = r.req();
    assert!(r.mm.fits_compute_backend_capacity(&req, &a).unwrap());
    r.mm.register_runtime_owner(OwnerId(2));
    r.mm.update_runtime_residency(OwnerId(2), r.gpu, 1536);
    assert!(!r.mm.fits_compute_backend_capacity(&req, &a).unwrap());
    // The owner's own runtime residency is not "other".
    let own = BackendMemoryRequest::new(r.gpu, OwnerId(2));
    let cap = r.mm.inspect_compute_backend_capacity(&own, &a).unwrap();
    assert_eq!(cap.available_budget_bytes, BUDGET);
    // Nothing of ours to evict: it cannot fit until the other owner goes.
    assert!(!r.mm.make_room_for(&req, &a, &[], &[]).unwrap());
    r.mm.remove_runtime_owner(OwnerId(2));
    assert!(r.mm.make_room_for(&req, &a, &[], &[]).unwrap());
}

#[test]
fn device_resident_weights_are_demoted_and_reloaded_from_the_file() {
    const BUDGET: u64 = 1024;
    let mut r = rig(
        "SIM_DEMOTE",
        1 << 20,
        Some(BUDGET),
        ResidencyMode::ParamBackend,
        true,
    );
    let (a, b) = (r.ids[..4].to_vec(), r.ids[4..].to_vec());
    r.run(&a, &[]);
    // Bound directly over the params copy on the device: no staging.
    assert_eq!(r.mm.block_counts(), (2, 0));
    let cands = r.mm.evictable_compute_backend_blocks(r.gpu, &[]);
    assert_eq!(cands.len(), 2);
    assert!(cands.iter().all(|c| c.requires_demotion && c.bytes == 512));
    // Protection hides them.
    assert!(r.mm.evictable_compute_backend_blocks(r.gpu, &a[..1]).len() == 1);

    r.run(&b, &[]);
    for p in &a {
        let info = r.mm.param_info(*p).unwrap();
        assert_eq!(info.mode, ResidencyMode::Disk, "evicting demotes for good");
        assert!(!info.loaded);
    }
    // A comes back from the file, bytes identical; B is demoted in turn.
    r.run(&a, &[]);
    assert!(b
        .iter()
        .all(|p| r.mm.param_info(*p).unwrap().mode == ResidencyMode::Disk));
    assert!(
        r.sim.peak_bytes() <= BUDGET,
        "peak {} > budget",
        r.sim.peak_bytes()
    );

    // Demoted (now Disk) weights are freed after use.
    r.mm.release_compute_backend_params(&a).unwrap();
    r.mm.release_params_backend_params(&a).unwrap();
    assert_eq!(r.sim.live_bytes(), 0);
}

#[test]
fn disk_mode_frees_its_buffers_after_use() {
    // Params on the CPU, staged to the device.
    let mut r = rig("SIM_DISK", 1 << 20, None, ResidencyMode::Disk, false);
    let all = r.ids.clone();
    r.run(&all, &[]);
    assert_eq!(r.sim.live_bytes(), 2048);
    let cpu_dev = r.mm.backend(r.cpu).unwrap().device().unwrap();
    assert!(r.mm.resident_bytes(&cpu_dev) >= 2048);
    r.mm.release_compute_backend_params(&all).unwrap();
    assert_eq!(r.sim.live_bytes(), 0);
    assert!(all.iter().all(|p| !r.mm.tensor(*p).unwrap().is_allocated()));
    r.mm.release_params_backend_params(&all).unwrap();
    assert_eq!(r.mm.resident_bytes(&cpu_dev), 0);
    assert_eq!(r.mm.block_counts(), (0, 0));
    // Used again: reloaded, identical.
    r.run(&all, &[]);

    // Params on the device itself.
    let mut d = rig("SIM_DISK_DIRECT", 1 << 20, None, ResidencyMode::Disk, true);
    let all = d.ids.clone();
    d.run(&all, &[]);
    assert_eq!(d.sim.live_bytes(), 2048);
    d.mm.release_compute_backend_params(&all).unwrap();
    d.mm.release_params_backend_params(&all).unwrap();
    assert_eq!(d.sim.live_bytes(), 0);

    // ParamBackend weights stay.
    let mut p = rig("SIM_PB", 1 << 20, None, ResidencyMode::ParamBackend, true);
    let all = p.ids.clone();
    p.run(&all, &[]);
    p.mm.release_compute_backend_params(&all).unwrap();
    p.mm.release_params_backend_params(&all).unwrap();
    assert_eq!(p.sim.live_bytes(), 2048);
    p.assert_on_device_identical(&all);
}

#[test]
fn a_failed_allocation_leaves_nothing_half_loaded() {
    // Room for one 512-byte chunk, not two.
    let mut r = rig("SIM_FAIL", 700, None, ResidencyMode::Disk, false);
    let a = r.ids[..4].to_vec();
    let err = r.mm.prepare_params(&a).unwrap_err();
    assert!(err.to_string().contains("staging"), "{err}");
    assert_eq!(r.sim.live_bytes(), 0);
    assert_eq!(r.mm.block_counts(), (0, 0));
    for p in &a {
        let info = r.mm.param_info(*p).unwrap();
        assert!(!info.loaded && !info.staged && info.pin_count == 0);
        assert!(!r.mm.tensor(*p).unwrap().is_allocated());
    }
    // Half of it fits.
    r.mm.prepare_params(&a[..2]).unwrap();
    r.assert_on_device_identical(&a[..2]);
}

#[test]
fn prefetch_then_activate() {
    let mut r = rig(
        "SIM_PREFETCH",
        1 << 20,
        None,
        ResidencyMode::ParamBackend,
        false,
    );
    let a = r.ids[..4].to_vec();
    let owner = OwnerId(7);
    assert_eq!(
        r.mm.prefetch_params(owner, &a),
        WeightPrefetchResult::Unsupported
    );
    r.mm.set_prefetch(true);
    assert_eq!(
        r.mm.prefetch_params(owner, &a),
        WeightPrefetchResult::Scheduled
    );
    assert!(a.iter().all(|p| !r.mm.param_info(*p).unwrap().staged));
    assert_eq!(r.sim.live_bytes(), 1024);
    // In flight: never an eviction candidate.
    assert!(r.mm.evictable_compute_backend_blocks(r.gpu, &[]).is_empty());
    assert!(r.mm.activate_prefetched_params(owner, &a).unwrap());
    assert!(a.iter().all(|p| r.mm.param_info(*p).unwrap().staged));
    r.assert_on_device_identical(&a);
    assert_eq!(
        r.mm.prefetch_params(owner, &a),
        WeightPrefetchResult::AlreadyResident
    );
    // Clearing frees what was not activated.
    let b = r.ids[4..].to_vec();
    assert_eq!(
        r.mm.prefetch_params(owner, &b),
        WeightPrefetchResult::Scheduled
    );
    r.mm.clear_prefetched_params(owner);
    assert_eq!(r.sim.live_bytes(), 1024);
    assert!(b.iter().all(|p| !r.mm.tensor(*p).unwrap().is_allocated()));
    // prepare uses a pending prefetch: it waits for the transfer thread's copies (one per
    // parameter, with uploads not coalesced) and makes none of its own.
    r.mm.set_coalesce_uploads(false);
    let copies = r.sim.stats().host_to_device_copies;
    assert_eq!(
        r.mm.prefetch_params(owner, &b),
        WeightPrefetchResult::Scheduled
    );
    r.mm.prepare_params(&b).unwrap();
    assert_eq!(r.sim.stats().host_to_device_copies, copies + b.len() as u64);
    r.assert_on_device_identical(&b);
}

#[test]
fn each_prepare_call_stages_its_own_blocks() {
    let mut r = rig(
        "SIM_PER_CALL",
        1 << 20,
        None,
        ResidencyMode::ParamBackend,
        false,
    );
    // Large chunks: everything one call stages fits one block.
    r.mm.set_max_block_bytes(sd_residency::MAX_RESIDENCY_BLOCK_BYTES);
    let first = r.ids[..3].to_vec();
    // Overlaps the first call in `ids[2]` (already staged: not staged again).
    let second = r.ids[2..6].to_vec();
    r.run(&first, &[]);
    r.run(&second, &[]);
    let mut blocks = r.mm.evictable_compute_backend_blocks(r.gpu, &[]);
    blocks.sort_by_key(|b| b.id);
    assert_eq!(blocks.len(), 2, "{blocks:?}");
    let mut a = blocks[0].params.clone();
    let mut b = blocks[1].params.clone();
    a.sort();
    b.sort();
    assert_eq!(a, first, "first call's block");
    assert_eq!(b, r.ids[3..6].to_vec(), "second call's block");
    assert!(a.iter().all(|p| !b.contains(p)), "blocks share a weight");
    // Each call's block is evictable on its own; the other call's weights stay.
    assert!(r.mm.evict_compute_backend_block(&blocks[0]));
    assert!(first.iter().all(|p| !r.mm.param_info(*p).unwrap().staged));
    assert!(r.ids[3..6]
        .iter()
        .all(|p| r.mm.param_info(*p).unwrap().staged));
    r.assert_on_device_identical(&r.ids[3..6]);
}

#[test]
fn upload_counter_matches_the_device_and_pageable_params_stay_correct() {
    for pinned in [true, false] {
        let mut r = rig(
            if pinned { "SIM_UP_P" } else { "SIM_UP_R" },
            1 << 20,
            Some(1024),
            ResidencyMode::ParamBackend,
            false,
        );
        r.mm.set_pinned_host_params(pinned);
        assert_eq!(r.mm.upload_bytes(), 0);
        let (a, b) = (r.ids[..4].to_vec(), r.ids[4..].to_vec());
        r.run(&a, &[]);
        r.run(&b, std::slice::from_ref(&a));
        r.run(&a, std::slice::from_ref(&b));
        // Three stagings of four 256-byte tensors, all host -> device.
        assert_eq!(r.mm.upload_bytes(), 3 * 1024);
        assert_eq!(r.mm.upload_bytes(), r.sim.stats().host_to_device_bytes);
    }
}

/// A staging pool: allocated once, counted once at its full size; staging copies are
/// sub-allocated from it (no device allocation per staged group), evicting one frees room in
/// the pool (reported as `pooled`) and no device memory; weights that do not fit in the pool
/// are missing device bytes; bytes identical to the file throughout; releasing the pool
/// takes its copies' memory back.
#[test]
fn staging_pool_sub_allocates_staging_copies_and_counts_once() {
    const POOL: u64 = 1024;
    let mut r = rig(
        "SIM_POOL",
        1 << 20,
        Some(POOL),
        ResidencyMode::ParamBackend,
        false,
    );
    let dev = r.sim.device();
    let (a, b) = (r.ids[..4].to_vec(), r.ids[4..].to_vec());
    assert!(r
        .mm
        .set_staging_pool(OwnerId(1), r.gpu, Some(POOL))
        .unwrap());
    assert_eq!(r.mm.staging_pool(r.gpu), Some((OwnerId(1), POOL)));
    assert_eq!(r.mm.resident_bytes(&dev), POOL);
    let allocations = r.sim.stats().allocations;
    // Four 256-byte tensors fit in the empty pool: nothing missing, no allocation.
    let req = r.req();
    let cap = r.mm.inspect_compute_backend_capacity(&req, &a).unwrap();
    assert!(cap.fits(false), "{cap:?}");
    r.run(&a, &[]);
    assert_eq!(r.sim.stats().allocations, allocations);
    assert_eq!(r.mm.resident_bytes(&dev), POOL);
    assert_eq!(r.mm.staging_pool_bytes(r.gpu), Some((POOL, 0)));
    // B does not fit beside A in the pool: its copies would be missing device bytes, which
    // the budget (all of it the pool's) does not have; room in the pool does.
    assert!(!r.mm.fits_compute_backend_capacity(&req, &b).unwrap());
    assert!(r.mm.fits_with_pool_room(&req, &b).unwrap());
    let blocks = r.mm.evictable_compute_backend_blocks(r.gpu, &[]);
    assert!(
        !blocks.is_empty() && blocks.iter().all(|b| b.pooled),
        "{blocks:?}"
    );
    // Evicting A's copies frees pool room: B then fits and is staged in the pool.
    r.run(&b, std::slice::from_ref(&a));
    assert!(a.iter().all(|p| !r.mm.tensor(*p).unwrap().is_allocated()));
    assert_eq!(r.sim.stats().allocations, allocations);
    assert_eq!(r.mm.resident_bytes(&dev), POOL);
    // And back, bytes identical.
    r.run(&a, std::slice::from_ref(&b));
    assert_eq!(r.sim.stats().allocations, allocations);
    // The same pool is kept; another size replaces it (with the copies in it).
    assert!(r
        .mm
        .set_staging_pool(OwnerId(1), r.gpu, Some(POOL))
        .unwrap());
    assert_eq!(r.sim.stats().allocations, allocations);
    assert!(r.mm.set_staging_pool(OwnerId(1), r.gpu, None).is_ok());
    assert_eq!(r.mm.staging_pool(r.gpu), None);
    assert!(a.iter().all(|p| !r.mm.tensor(*p).unwrap().is_allocated()));
    assert_eq!(r.mm.resident_bytes(&dev), 0);
    assert_eq!(r.sim.live_bytes(), 0);
    // Without a pool, staging allocates again.
    r.run(&a, &[]);
    assert!(r.sim.stats().allocations > allocations);
    assert!(r.sim.peak_bytes() <= POOL, "peak {}", r.sim.peak_bytes());
    // Removing its owner frees a pool.
    let req = r.req();
    r.mm.release_compute_backend_params(&a).unwrap();
    assert!(r.mm.make_room_for(&req, &[], &[], &[]).unwrap());
    assert!(r
        .mm
        .set_staging_pool(OwnerId(7), r.gpu, Some(POOL))
        .unwrap());
    r.mm.register_runtime_owner(OwnerId(7));
    r.mm.remove_runtime_owner(OwnerId(7));
    assert_eq!(r.mm.staging_pool(r.gpu), None);
}

/// Room kept for a backend runtime's operator temporaries comes out of the device's budget
/// once, by the largest amount asked for (a pool keeps its high-water mark), and the
/// budget a later `--max-vram` resolves to keeps it out too.
#[test]
fn backend_temporaries_lower_the_budget_by_the_largest_ask() {
    let r = rig(
        "SIMTMP0",
        1 << 20,
        Some(100_000),
        ResidencyMode::ParamBackend,
        false,
    );
    let mut mm = r.mm;
    assert_eq!(mm.backend_budget(r.gpu), Some(100_000));
    mm.reserve_backend_temporaries(r.gpu, 10_000);
    assert_eq!(mm.backend_budget(r.gpu), Some(90_000));
    // A smaller ask changes nothing; a larger one lowers by the difference.
    mm.reserve_backend_temporaries(r.gpu, 4_000);
    assert_eq!(mm.backend_budget(r.gpu), Some(90_000));
    mm.reserve_backend_temporaries(r.gpu, 25_000);
    assert_eq!(mm.backend_budget(r.gpu), Some(75_000));
    // The CPU backend has no budget to lower.
    mm.reserve_backend_temporaries(r.cpu, 1 << 30);
    let max_vram = sd_residency::capacity::MaxVram::parse("200000b").unwrap();
    mm.apply_max_vram(&max_vram);
    assert_eq!(mm.backend_budget(r.gpu), Some(200_000 - 25_000));
    // What a shortfall's message adds to the limit to name the budget to ask for.
    let device = |id| mm.backend(id).unwrap().device().unwrap();
    assert_eq!(mm.backend_temporaries(&device(r.gpu)), 25_000);
    assert_eq!(mm.backend_temporaries(&device(r.cpu)), 0);
}
