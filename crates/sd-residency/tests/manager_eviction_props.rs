//! Eviction candidate properties: pinned, protected and prefetching weights never appear;
//! demotion candidates satisfy every condition. Checked on the pure rules over arbitrary
//! states, and on a real manager over random pins, protections, modes and prefetches.

#[path = "common/manager.rs"]
mod support;

use std::collections::HashSet;
use std::sync::{Arc, OnceLock};

use proptest::prelude::*;
use sd_formats::files::TensorCatalog;
use sd_residency::manager::eviction::{
    demotable, evictable_blocks, BlockFacts, BlockKind, MemberFacts,
};
use sd_residency::{
    BackendId, BlockId, Component, DeviceResidencyManager, ModelManager, OwnerId, ParamId,
    ParamSpec, ResidencyMode, SourceId,
};
use sd_tensor::ggml::{Backend, SimDevice, SimOptions};
use support::*;

fn member() -> impl Strategy<Value = MemberFacts> {
    (
        0u64..64,
        any::<bool>(),
        proptest::collection::vec(any::<bool>(), 10),
        0u64..100,
    )
        .prop_map(|(param, disk, f, last_use_epoch)| MemberFacts {
            param: ParamId(param),
            mode: if disk {
                ResidencyMode::Disk
            } else {
                ResidencyMode::ParamBackend
            },
            // Bias towards the "clean" value so that candidates exist.
            pinned: f[0] && f[1],
            protected: f[1] && f[2],
            prefetching: f[2] && f[3],
            staged: f[3] && f[4],
            computed_here: !(f[4] && f[5]),
            reloadable: !(f[5] && f[6]),
            lora_applied: f[6] && f[7],
            mmapped: f[7] && f[8],
            view: f[8] && f[9],
            split: f[9] && f[0],
            last_use_epoch,
        })
}

fn block() -> impl Strategy<Value = BlockFacts> {
    (
        0u64..1000,
        any::<bool>(),
        proptest::collection::vec(any::<bool>(), 3),
        0u64..1 << 30,
        proptest::collection::vec(member(), 0..5),
    )
        .prop_map(|(id, staging, f, bytes, members)| BlockFacts {
            id: BlockId(id),
            kind: if staging {
                BlockKind::Staging
            } else {
                BlockKind::Storage
            },
            on_device: !(f[0] && f[1]),
            host_query: f[1] && f[2],
            mapped: f[2] && f[0],
            bytes,
            members,
        })
}

/// An independent statement of the rules.
fn oracle(b: &BlockFacts) -> Option<bool> {
    if !b.on_device || b.mapped || b.members.is_empty() {
        return None;
    }
    if b.members
        .iter()
        .any(|m| m.pinned || m.protected || m.prefetching)
    {
        return None;
    }
    match b.kind {
        BlockKind::Staging => Some(false),
        BlockKind::Storage => {
            let mut demote = false;
            for m in &b.members {
                if m.staged || m.mmapped {
                    return None;
                }
                if m.mode == ResidencyMode::ParamBackend {
                    let ok = !b.host_query
                        && m.computed_here
                        && m.reloadable
                        && !m.lora_applied
                        && !m.view
                        && !m.split;
                    if !ok {
                        return None;
                    }
                    demote = true;
                }
            }
            Some(demote)
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn candidate_rules(blocks in proptest::collection::vec(block(), 0..12)) {
        let out = evictable_blocks(BackendId(3), &blocks);
        let mut i = 0;
        for b in &blocks {
            match oracle(b) {
                None => continue,
                Some(demote) => {
                    let c = &out[i];
                    i += 1;
                    prop_assert_eq!(c.id, b.id);
                    prop_assert_eq!(c.backend, BackendId(3));
                    prop_assert_eq!(c.bytes, b.bytes);
                    prop_assert_eq!(c.requires_demotion, demote);
                    prop_assert_eq!(
                        c.last_use_epoch,
                        b.members.iter().map(|m| m.last_use_epoch).max().unwrap()
                    );
                    let ids: Vec<ParamId> = b.members.iter().map(|m| m.param).collect();
                    prop_assert_eq!(&c.params, &ids);
                }
            }
        }
        prop_assert_eq!(i, out.len());
        for c in &out {
            let b = blocks.iter().find(|b| b.id == c.id && b.members.iter().map(|m| m.param).eq(c.params.iter().copied())).unwrap();
            prop_assert!(b.on_device && !b.mapped);
            for m in &b.members {
                prop_assert!(!m.pinned && !m.protected && !m.prefetching);
                if c.requires_demotion && m.mode == ResidencyMode::ParamBackend {
                    prop_assert_eq!(b.kind, BlockKind::Storage);
                    prop_assert!(demotable(m, b.host_query));
                    prop_assert!(!b.host_query && m.computed_here && m.reloadable);
                    prop_assert!(!m.lora_applied && !m.mmapped && !m.view && !m.split && !m.staged);
                }
            }
        }
    }
}

/// Eight `[4, 16]` f32 weights in one file, written once.
fn model() -> &'static (std::path::PathBuf, Vec<FileTensor>) {
    static M: OnceLock<(std::path::PathBuf, Vec<FileTensor>)> = OnceLock::new();
    M.get_or_init(|| {
        let t: Vec<FileTensor> = (0..8)
            .map(|i| {
                f32_tensor(
                    &format!("model.diffusion_model.p{i}.weight"),
                    &[4, 16],
                    i as f32,
                )
            })
            .collect();
        let p = temp_path("props");
        write_safetensors(&p, &t);
        (p, t)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn manager_candidates_respect_pins_protection_and_prefetch(
        // Per weight: mode (Disk?), params on the device?, pinned?, protected?, prefetch?
        flags in proptest::collection::vec(proptest::collection::vec(any::<bool>(), 5), 8),
        chunk in prop_oneof![Just(256u64), Just(512), Just(1024)],
    ) {
        let (path, tensors) = model();
        let sim = SimDevice::new("SIM_PROPS", 1 << 20, SimOptions::default()).unwrap();
        let mut loader = TensorCatalog::new();
        loader.add_file(path, None).unwrap();
        let mut mm = ModelManager::new(loader);
        mm.set_device_reserve(0);
        mm.set_max_block_bytes(chunk);
        mm.set_load_threads(1);
        mm.set_prefetch(true);
        let cpu = mm.add_backend(Arc::new(Backend::cpu(1).unwrap())).unwrap();
        let gpu = mm.add_backend(Arc::new(sim.backend().unwrap())).unwrap();
        let c = ctx(16);
        let descs = descs_for(&c, tensors);
        let mut ids = Vec::new();
        for (f, d) in flags.iter().zip(&descs) {
            let spec = ParamSpec {
                component: Component::Diffusion,
                mode: if f[0] { ResidencyMode::Disk } else { ResidencyMode::ParamBackend },
                params_backend: if f[1] { gpu } else { cpu },
                compute_backend: gpu,
                source: SourceId::MAIN,
            };
            ids.extend(mm.register_params(spec, std::slice::from_ref(d)).unwrap());
        }
        let (pf, rest): (Vec<_>, Vec<_>) = ids.iter().zip(&flags).partition(|(_, f)| f[4] && !f[1]);
        let prefetching: Vec<ParamId> = pf.iter().map(|(p, _)| **p).collect();
        let others: Vec<ParamId> = rest.iter().map(|(p, _)| **p).collect();
        mm.prepare_params(&others).unwrap();
        mm.unpin_params(&others).unwrap();
        let _ = mm.prefetch_params(OwnerId(1), &prefetching);
        let pinned: Vec<ParamId> = ids.iter().zip(&flags).filter(|(_, f)| f[2]).map(|(p, _)| *p).collect();
        mm.pin_params(&pinned).unwrap();
        let protected: Vec<ParamId> = ids.iter().zip(&flags).filter(|(_, f)| f[3]).map(|(p, _)| *p).collect();

        let pinned: HashSet<ParamId> = pinned.into_iter().collect();
        let prefetched: HashSet<ParamId> = ids.iter().copied().filter(|p| {
            let i = mm.param_info(*p).unwrap();
            !i.resident_on_compute && mm.tensor(*p).unwrap().is_allocated()
        }).collect();
        for backend in [gpu, cpu] {
            for c in mm.evictable_compute_backend_blocks(backend, &protected) {
                for p in &c.params {
                    prop_assert!(!pinned.contains(p), "pinned {p} in {c:?}");
                    prop_assert!(!protected.contains(p), "protected {p} in {c:?}");
                    prop_assert!(!prefetched.contains(p), "prefetching {p} in {c:?}");
                    let info = mm.param_info(*p).unwrap();
                    if c.requires_demotion && info.mode == ResidencyMode::ParamBackend {
                        prop_assert_eq!(backend, gpu);
                        prop_assert_eq!(info.params_backend, gpu);
                        prop_assert!(info.lora_epoch.is_none() && !info.mmapped && !info.staged);
                    }
                }
                // Evicting a candidate frees its bytes.
                let before = mm.resident_bytes(&mm.backend(backend).unwrap().device().unwrap());
                prop_assert!(mm.evict_compute_backend_block(&c));
                let after = mm.resident_bytes(&mm.backend(backend).unwrap().device().unwrap());
                prop_assert_eq!(before - after, c.bytes);
                prop_assert!(!mm.evict_compute_backend_block(&c), "evicted twice");
            }
        }
        // Whatever was evicted, pinned weights still hold the file's bytes.
        for p in &pinned {
            let i = ids.iter().position(|x| x == p).unwrap();
            let t = mm.tensor(*p).unwrap();
            if mm.param_info(*p).unwrap().resident_on_compute {
                prop_assert_eq!(t.read_bytes().unwrap(), tensors[i].bytes.clone());
            }
        }
        prop_assert_eq!(sim.stats().faults, 0);
    }
}
