//! Cut marks: model code records which tensors end a segment.
//!
//! A mark is data ([`CutMarks`]), not a naming convention: the planner reads it when the
//! graph is captured ([`CapturedGraph::capture`](crate::CapturedGraph::capture)). Marking
//! checks what it can at once and names the `mark` call site in every error:
//! the same tensor marked twice, the same `group|output` name on two tensors, a leaf marked
//! (only op results can be cuts) and unusable names are errors. A cut that no later segment
//! consumes, or a mark whose tensor is not in the graph, is reported by the planner as a
//! [`Diagnostic`](crate::Diagnostic) carrying the mark's location.

use std::collections::HashMap;
use std::fmt;
use std::panic::Location;

use sd_tensor::ggml::{GTensor, TensorId};

use crate::error::{GraphCutError, MarkConflict, Result};

/// Group name of the final segment's outputs (the graph results that are not cuts). Model
/// groups may not start with `<`, so it never collides with one.
pub const FINAL_GROUP: &str = "<final>";

/// The name of a cut: a group (one segment) and an output within the group.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CutName {
    group: String,
    output: String,
}

impl CutName {
    /// A model cut name. The group and output must be non-empty and free of `|`; the group
    /// must not start with `<` (reserved for the planner's own names).
    pub fn new(group: &str, output: &str) -> std::result::Result<CutName, String> {
        if group.is_empty() || output.is_empty() {
            return Err("group and output must not be empty".into());
        }
        if group.contains('|') || output.contains('|') {
            return Err("'|' is not allowed in group or output names".into());
        }
        if group.starts_with('<') {
            return Err("group names starting with '<' are reserved".into());
        }
        Ok(CutName {
            group: group.to_string(),
            output: output.to_string(),
        })
    }

    /// The name under which the final segment reports graph output node `node`.
    pub fn final_output(node: usize) -> CutName {
        CutName {
            group: FINAL_GROUP.to_string(),
            output: format!("node{node}"),
        }
    }

    /// The group (segment) name.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The output name within the group.
    pub fn output(&self) -> &str {
        &self.output
    }

    /// Whether this names a final-segment output rather than a model cut.
    pub fn is_final(&self) -> bool {
        self.group == FINAL_GROUP
    }
}

impl fmt::Display for CutName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}|{}", self.group, self.output)
    }
}

/// One cut mark: which tensor, under which name, marked where.
#[derive(Clone, Debug)]
pub struct CutMark {
    /// The marked tensor.
    pub tensor: TensorId,
    /// The tensor's name when it was marked (for messages).
    pub tensor_name: String,
    /// The cut name.
    pub name: CutName,
    /// Where `mark` was called.
    pub location: &'static Location<'static>,
    /// Granularity: 0 for a block boundary ([`CutMarks::mark`]), higher for finer cuts
    /// inside a block ([`CutMarks::mark_fine`]) that the engine uses only where a coarser
    /// segment does not fit its budget.
    pub level: u8,
}

/// The cut marks of one graph build. Model code calls [`CutMarks::mark`] while building the
/// graph; the planner reads the marks when the graph is captured.
#[derive(Clone, Debug, Default)]
pub struct CutMarks {
    marks: Vec<CutMark>,
    by_tensor: HashMap<TensorId, usize>,
    by_name: HashMap<CutName, usize>,
    /// Prefix of the group names of fine marks (see [`CutMarks::set_scope`]).
    scope: String,
}

/// Granularity of a fine mark between the layers of a block (a resnet, a transformer,
/// an up/down sampling convolution).
pub const LEVEL_LAYER: u8 = 1;
/// Granularity of a fine mark inside a layer (after a transformer's self-attention,
/// cross-attention or feed-forward; after the first half of a residual block).
pub const LEVEL_SUBLAYER: u8 = 2;

impl CutMarks {
    /// No marks.
    pub fn new() -> CutMarks {
        CutMarks::default()
    }

    /// Marks `tensor` as output `output` of cut group `group`. Errors (naming this call
    /// site and the earlier one): the tensor is already marked, the name is already used,
    /// the tensor is a leaf, or the name is unusable (see [`CutName::new`]).
    #[track_caller]
    pub fn mark(&mut self, tensor: &GTensor, group: &str, output: &str) -> Result<()> {
        self.mark_level(tensor, group, output, 0, Location::caller())
    }

    /// Sets the prefix of the group names of the fine marks that follow (model code sets
    /// it to the block it is building, for example `input_blocks.4`).
    pub fn set_scope(&mut self, scope: &str) {
        self.scope = scope.to_string();
    }

    /// Marks `tensor` as a fine cut of granularity `level` (at least 1, see
    /// [`LEVEL_LAYER`] and [`LEVEL_SUBLAYER`]) in group `<scope>/<label>` (output `h`).
    /// Fine cuts lie inside a block: the engine plans with block boundaries (level 0) and
    /// uses the fine cuts inside a block only when a segment there does not fit its budget.
    /// The same errors as [`CutMarks::mark`]; a level of 0 is an invalid name.
    #[track_caller]
    pub fn mark_fine(&mut self, tensor: &GTensor, level: u8, label: &str) -> Result<()> {
        self.mark_fine_at(tensor, level, label, "h", Location::caller())
    }

    /// Like [`CutMarks::mark_fine`], naming the output: a fine cut that carries several
    /// tensors (a transformer block's image and text streams) marks each under one label.
    #[track_caller]
    pub fn mark_fine_output(
        &mut self,
        tensor: &GTensor,
        level: u8,
        label: &str,
        output: &str,
    ) -> Result<()> {
        self.mark_fine_at(tensor, level, label, output, Location::caller())
    }

    fn mark_fine_at(
        &mut self,
        tensor: &GTensor,
        level: u8,
        label: &str,
        output: &str,
        at: &'static Location<'static>,
    ) -> Result<()> {
        let group = if self.scope.is_empty() {
            label.to_string()
        } else {
            format!("{}/{label}", self.scope)
        };
        if level == 0 {
            return Err(GraphCutError::InvalidCutName {
                group,
                output: output.into(),
                reason: "a fine mark needs a level of at least 1".into(),
                at: at.to_string(),
            });
        }
        self.mark_level(tensor, &group, output, level, at)
    }

    fn mark_level(
        &mut self,
        tensor: &GTensor,
        group: &str,
        output: &str,
        level: u8,
        at: &'static Location<'static>,
    ) -> Result<()> {
        let name = CutName::new(group, output).map_err(|reason| GraphCutError::InvalidCutName {
            group: group.to_string(),
            output: output.to_string(),
            reason,
            at: at.to_string(),
        })?;
        if tensor.is_leaf() {
            return Err(GraphCutError::CutOnLeaf {
                cut: name.to_string(),
                tensor: tensor.name(),
                at: at.to_string(),
            });
        }
        let id = tensor.id();
        if let Some(&i) = self.by_tensor.get(&id) {
            let first = &self.marks[i];
            return Err(GraphCutError::DuplicateMark {
                tensor: tensor.name(),
                marks: Box::new(MarkConflict {
                    first: first.name.to_string(),
                    first_at: first.location.to_string(),
                    second: name.to_string(),
                    second_at: at.to_string(),
                }),
            });
        }
        if let Some(&i) = self.by_name.get(&name) {
            let first = &self.marks[i];
            return Err(GraphCutError::DuplicateCutName {
                cut: name.to_string(),
                marks: Box::new(MarkConflict {
                    first: first.tensor_name.clone(),
                    first_at: first.location.to_string(),
                    second: tensor.name(),
                    second_at: at.to_string(),
                }),
            });
        }
        let i = self.marks.len();
        self.by_tensor.insert(id, i);
        self.by_name.insert(name.clone(), i);
        self.marks.push(CutMark {
            tensor: id,
            tensor_name: tensor.name(),
            name,
            location: at,
            level,
        });
        tracing::trace!(cut = %self.marks[i].name, tensor = %self.marks[i].tensor_name, "cut marked");
        Ok(())
    }

    /// Like [`CutMarks::mark`], but a missing tensor (an optional output that this model
    /// variant does not produce) is a no-op.
    #[track_caller]
    pub fn mark_opt(&mut self, tensor: Option<&GTensor>, group: &str, output: &str) -> Result<()> {
        match tensor {
            Some(t) => self.mark(t, group, output),
            None => Ok(()),
        }
    }

    /// The mark on a tensor, if any.
    pub fn get(&self, tensor: TensorId) -> Option<&CutMark> {
        self.by_tensor.get(&tensor).map(|&i| &self.marks[i])
    }

    /// The mark with a cut name, if any.
    pub fn by_name(&self, name: &CutName) -> Option<&CutMark> {
        self.by_name.get(name).map(|&i| &self.marks[i])
    }

    /// All marks in marking order.
    pub fn iter(&self) -> impl Iterator<Item = &CutMark> {
        self.marks.iter()
    }

    /// Number of marks.
    pub fn len(&self) -> usize {
        self.marks.len()
    }

    /// Whether there are no marks.
    pub fn is_empty(&self) -> bool {
        self.marks.is_empty()
    }

    /// The same marks with groups merged: each mark's group becomes `merge(group)`. Marks
    /// whose group is renamed get the output name `<old group>.<old output>`, so that the
    /// outputs of merged groups stay distinct; marks whose group is kept keep their names.
    /// The engine uses this to run several consecutive cut groups as one segment when the
    /// budget allows, without the model marking anything differently.
    pub fn regrouped(&self, merge: impl Fn(&str) -> String) -> Result<CutMarks> {
        let mut out = CutMarks::new();
        for m in &self.marks {
            let group = merge(m.name.group());
            let name = if group == m.name.group() {
                m.name.clone()
            } else {
                let output = format!("{}.{}", m.name.group(), m.name.output());
                CutName::new(&group, &output).map_err(|reason| GraphCutError::InvalidCutName {
                    group: group.clone(),
                    output: output.clone(),
                    reason,
                    at: m.location.to_string(),
                })?
            };
            if let Some(&i) = out.by_name.get(&name) {
                let first = &out.marks[i];
                return Err(GraphCutError::DuplicateCutName {
                    cut: name.to_string(),
                    marks: Box::new(MarkConflict {
                        first: first.tensor_name.clone(),
                        first_at: first.location.to_string(),
                        second: m.tensor_name.clone(),
                        second_at: m.location.to_string(),
                    }),
                });
            }
            let i = out.marks.len();
            out.by_tensor.insert(m.tensor, i);
            out.by_name.insert(name.clone(), i);
            out.marks.push(CutMark {
                tensor: m.tensor,
                tensor_name: m.tensor_name.clone(),
                name,
                location: m.location,
                level: m.level,
            });
        }
        Ok(out)
    }

    /// The marks `keep` accepts (same names, levels and locations).
    pub fn select(&self, keep: impl Fn(&CutMark) -> bool) -> CutMarks {
        let mut out = CutMarks::new();
        for m in self.marks.iter().filter(|m| keep(m)) {
            let i = out.marks.len();
            out.by_tensor.insert(m.tensor, i);
            out.by_name.insert(m.name.clone(), i);
            out.marks.push(m.clone());
        }
        out
    }

    /// The block boundaries only (level 0).
    pub fn coarse(&self) -> CutMarks {
        self.select(|m| m.level == 0)
    }

    /// The finest level among the marks (0 without fine marks).
    pub fn max_level(&self) -> u8 {
        self.marks.iter().map(|m| m.level).max().unwrap_or(0)
    }

    /// Number of block boundaries (level-0 marks).
    pub fn coarse_len(&self) -> usize {
        self.marks.iter().filter(|m| m.level == 0).count()
    }

    /// Removes all marks (before building the next graph).
    pub fn clear(&mut self) {
        self.marks.clear();
        self.by_tensor.clear();
        self.by_name.clear();
        self.scope.clear();
    }
}
