//! `sd-residency`: where every model weight lives.
//!
//! It owns the [`residency::DeviceResidencyManager`] trait and its implementation [`ModelManager`]
//! (parameter states, storage and staging blocks, loading, eviction candidates, LoRA, model
//! sources), and the [`capacity`] arithmetic that answers whether a piece of work fits a
//! device under its free memory and budget.

pub mod capacity;
pub mod manager;
pub mod residency;

pub use manager::{
    Component, LoraSpec, ModelManager, ParamInfo, ParamSpec, ResidencyMode, UploadOptions,
    UploadSpan, MAX_RESIDENCY_BLOCK_BYTES,
};
pub use residency::{
    BackendId, BackendMemoryRequest, BlockId, DeviceResidencyManager, OwnerId, ParamId,
    ResidencyError, SourceId, WeightPrefetchResult, WeightResidencyBlock,
};
