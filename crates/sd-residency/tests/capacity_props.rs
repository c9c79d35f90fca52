//! Property tests of the capacity arithmetic.

use proptest::prelude::*;
use sd_residency::capacity::{inspect_capacity, DeviceClass, DeviceMemoryRequest, DeviceState};

fn any_class() -> impl Strategy<Value = DeviceClass> {
    prop_oneof![
        Just(DeviceClass::Host),
        Just(DeviceClass::Discrete),
        Just(DeviceClass::Integrated)
    ]
}

prop_compose! {
    fn any_state()(class in any_class(), free in proptest::option::of(any::<u64>()), total in any::<u64>(),
                   w in any::<u64>(), rt in any::<u64>(), other in any::<u64>(),
                   budget in proptest::option::of(any::<u64>()), reserve in prop_oneof![Just(512u64 << 20), any::<u64>()])
                   -> DeviceState {
        DeviceState { class, reported_free: free, reported_total: total, tracked_weight_bytes: w,
                      tracked_runtime_bytes: rt, other_owners_runtime_bytes: other, budget, reserve_bytes: reserve }
    }
}

prop_compose! {
    fn any_request()(p in any::<u64>(), m in any::<u64>(), o in any::<u64>()) -> DeviceMemoryRequest {
        DeviceMemoryRequest { pending_bytes: p, missing_weight_bytes: m, owner_runtime_bytes: o }
    }
}

// Small numbers, so that fits and misses both happen often.
prop_compose! {
    fn small_state()(class in any_class(), free in proptest::option::of(0u64..10_000), total in 0u64..10_000,
                     w in 0u64..4_000, rt in 0u64..4_000, other in 0u64..4_000,
                     budget in proptest::option::of(0u64..10_000), reserve in 0u64..1_000) -> DeviceState {
        DeviceState { class, reported_free: free, reported_total: total, tracked_weight_bytes: w,
                      tracked_runtime_bytes: rt, other_owners_runtime_bytes: other, budget, reserve_bytes: reserve }
    }
}

prop_compose! {
    fn small_request()(p in 0u64..5_000, m in 0u64..5_000, o in 0u64..5_000) -> DeviceMemoryRequest {
        DeviceMemoryRequest { pending_bytes: p, missing_weight_bytes: m, owner_runtime_bytes: o }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// No input overflows (debug builds panic on overflow).
    #[test]
    fn never_overflows(s in any_state(), r in any_request()) {
        let c = inspect_capacity(&s, &r);
        let _ = (c.fits(false), c.fits(true), c.device_shortfall(), c.budget_shortfall());
    }

    /// More free memory never turns a fit into a miss.
    #[test]
    fn monotone_in_free(s in small_state(), r in small_request(), extra in 0u64..5_000) {
        if let Some(free) = s.reported_free {
            let more = DeviceState { reported_free: Some((free + extra).min(s.reported_total)), ..s };
            if free <= s.reported_total && inspect_capacity(&s, &r).fits(false) {
                prop_assert!(inspect_capacity(&more, &r).fits(false));
            }
        }
    }

    /// A larger budget never turns a fit into a miss; no budget is the largest.
    #[test]
    fn monotone_in_budget(s in small_state(), r in small_request(), extra in 0u64..5_000) {
        if let Some(b) = s.budget {
            let fits = inspect_capacity(&s, &r).fits(false);
            let more = DeviceState { budget: Some(b + extra), ..s };
            let none = DeviceState { budget: None, ..s };
            if fits {
                prop_assert!(inspect_capacity(&more, &r).fits(false));
                prop_assert!(inspect_capacity(&none, &r).fits(false));
            }
        }
    }

    /// A smaller request never turns a fit into a miss.
    #[test]
    fn anti_monotone_in_request(s in small_state(), r in small_request(), dp in 0u64..5_000, dm in 0u64..5_000, doo in 0u64..5_000) {
        let bigger = DeviceMemoryRequest { pending_bytes: r.pending_bytes + dp, missing_weight_bytes: r.missing_weight_bytes + dm, owner_runtime_bytes: r.owner_runtime_bytes + doo };
        if inspect_capacity(&s, &bigger).fits(false) {
            prop_assert!(inspect_capacity(&s, &r).fits(false));
        }
        if inspect_capacity(&s, &bigger).fits(true) {
            prop_assert!(inspect_capacity(&s, &r).fits(true));
        }
    }

    /// A wrapped report never fits on a discrete device, and on an integrated one only after
    /// reclamation.
    #[test]
    fn wrapped_reports_need_reclamation(s in small_state(), r in small_request(), over in 1u64..5_000) {
        let wrapped = DeviceState { reported_free: Some(s.reported_total + over), ..s };
        let c = inspect_capacity(&wrapped, &r);
        match s.class {
            DeviceClass::Discrete => prop_assert!(!c.fits(false) && !c.fits(true)),
            DeviceClass::Integrated => prop_assert!(!c.fits(false)),
            DeviceClass::Host => prop_assert!(c.fits(false)),
        }
    }

    /// Owners on one device share the budget: what each is granted adds up to at most the
    /// budget minus tracked weights.
    #[test]
    fn owner_budgets_add_up(budget in 0u64..10_000, weights in 0u64..10_000, owners in proptest::collection::vec(0u64..3_000, 1..6)) {
        let mut granted: Vec<u64> = Vec::new();
        for want in owners {
            let others: u64 = granted.iter().sum();
            let mut s = DeviceState::new(DeviceClass::Discrete, Some(1 << 40), 1 << 40);
            s.reserve_bytes = 0;
            s.budget = Some(budget);
            s.tracked_weight_bytes = weights;
            s.other_owners_runtime_bytes = others;
            let r = DeviceMemoryRequest { pending_bytes: want, missing_weight_bytes: 0, owner_runtime_bytes: 0 };
            if inspect_capacity(&s, &r).fits(false) {
                granted.push(want);
            }
        }
        let total: u64 = granted.iter().sum();
        prop_assert!(granted.is_empty() || weights + total <= budget);
    }
}
