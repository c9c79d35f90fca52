//! Model sources: auxiliary catalogs (an upscaler loaded after the main model).

use super::ModelManager;
use crate::residency::{ResidencyError, Result, SourceId};
use sd_formats::files::TensorCatalog;

impl ModelManager {
    /// Registers an auxiliary model's catalog (its own files and names). Weights registered
    /// from it are never LoRA-patched and are grouped apart from the main model's.
    pub fn register_model_source(&mut self, loader: TensorCatalog) -> Result<SourceId> {
        let id = SourceId(self.next_source);
        if loader.files().is_empty() {
            return Err(ResidencyError::Source {
                source_id: id,
                detail: "a model source needs at least one model file".into(),
            });
        }
        let known = |l: &TensorCatalog| -> Vec<std::path::PathBuf> {
            l.files().iter().map(|f| f.path.clone()).collect()
        };
        let new_paths = known(&loader);
        for existing in self.sources.values() {
            if known(existing).iter().any(|p| new_paths.contains(p)) {
                return Err(ResidencyError::Source {
                    source_id: id,
                    detail: "its model file is already registered".into(),
                });
            }
        }
        self.next_source += 1;
        self.sources.insert(id, loader);
        Ok(id)
    }

    /// Unregisters an auxiliary model source; refused while weights from it are registered.
    pub fn unregister_model_source(&mut self, source: SourceId) -> Result<()> {
        if source == SourceId::MAIN || !self.sources.contains_key(&source) {
            return Err(ResidencyError::UnknownSource(source));
        }
        let n = self.states.values().filter(|s| s.source == source).count();
        if n > 0 {
            return Err(ResidencyError::Source {
                source_id: source,
                detail: format!("{n} weight(s) from it are still registered"),
            });
        }
        self.sources.remove(&source);
        Ok(())
    }

    /// The catalog of a source.
    pub fn source(&self, source: SourceId) -> Option<&TensorCatalog> {
        self.sources.get(&source)
    }
}
