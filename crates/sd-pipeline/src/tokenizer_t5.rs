//! The T5 tokenizer (SentencePiece Unigram) of FLUX.1's and SD3's T5-XXL encoder.
//!
//! Tokenization is the `tokenizers` crate's, built as pure Rust (`default-features = false,
//! features = ["fancy-regex"]`: no Oniguruma, no esaxx C++), loading the same
//! `tokenizer.json` transformers' `T5TokenizerFast` loads, so ids equal transformers':
//! SentencePiece's precompiled NFKC-based normaliser, runs of spaces collapsed, Metaspace
//! `▁` pieces, Viterbi over the Unigram piece scores; `<pad>` 0, `</s>` 1, `<unk>` 2 and
//! the `<extra_id_N>` sentinels are special tokens (matched in the text as transformers does).
//!
//! # The vocabulary
//!
//! No checkpoint carries it (safetensors files hold tensors only) and sd-rs runs without a
//! model hub, so the T5 v1.1 vocabulary ships with sd-rs: `assets/t5_tokenizer.json.gz`,
//! the `tokenizer.json` of `google/t5-v1_1-xxl` (32 000 pieces plus 100 sentinels; the
//! FLUX.1 and SD3 repositories' `tokenizer_2`/`tokenizer_3` are the same file), gzip'd (593
//! KiB). Source: stable-diffusion.cpp's generated header
//! `src/tokenizers/vocab/clip_t5.hpp` (array `t5_tokenizer_json_str`), as vendored in the
//! `stable-diffusion-cpp-python` 0.4.7 source distribution on PyPI, extracted byte for byte.
//! License: the T5 vocabulary is Google's, Apache-2.0 (google-research/text-to-text-transfer-
//! transformer); stable-diffusion.cpp, which embeds it, is MIT. See `assets/README.md`.
//!
//! A llama.cpp T5 GGUF carries its own vocabulary in its metadata (`tokenizer.ggml.tokens`,
//! `scores`, `token_type`, `precompiled_charsmap`); [`T5Tokenizer::from_gguf`] builds the
//! same tokenizer from it. [`T5Tokenizer::from_file`] loads a user-given `tokenizer.json`.
//!
//! # Lengths
//!
//! The pipelines encode a prompt, append `</s>`, truncate to the maximum length (keeping
//! `</s>` last) and pad with `<pad>` to it, and run the encoder without an attention mask, so
//! the padded length changes the result: [`T5Tokenizer::encode_padded`]. diffusers' defaults
//! ([`FLUX_DEV_MAX_TOKENS`], [`FLUX_SCHNELL_MAX_TOKENS`], [`SD3_MAX_TOKENS`]) differ from
//! stable-diffusion.cpp's (256 for FLUX, 77-token chunks for SD3); sd-rs follows diffusers.

use std::io::Read;
use std::path::{Path, PathBuf};

use sd_formats::files::gguf::{GgufArray, GgufHeader, GgufValue};
use thiserror::Error;
use tokenizers::models::unigram::Unigram;
use tokenizers::normalizers::replace::ReplacePattern;
use tokenizers::normalizers::{Precompiled, Replace, Sequence};
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::{AddedToken, Tokenizer};

/// `<pad>`: what the pipelines pad with.
pub const T5_PAD: i32 = 0;
/// `</s>`: appended to every prompt.
pub const T5_EOS: i32 = 1;
/// `<unk>`.
pub const T5_UNK: i32 = 2;
/// FLUX.1-dev's T5 length (diffusers `FluxPipeline`, `max_sequence_length=512`).
pub const FLUX_DEV_MAX_TOKENS: usize = 512;
/// FLUX.1-schnell's T5 length (its model card and diffusers docs: `max_sequence_length=256`,
/// the most schnell was trained with).
pub const FLUX_SCHNELL_MAX_TOKENS: usize = 256;
/// SD3/3.5's T5 length (diffusers `StableDiffusion3Pipeline`, `max_sequence_length=256`).
pub const SD3_MAX_TOKENS: usize = 256;

/// The shipped T5 v1.1 `tokenizer.json`, gzip'd.
static BUILTIN: &[u8] = include_bytes!("../assets/t5_tokenizer.json.gz");

/// Why a T5 tokenizer could not be built or could not encode.
#[derive(Debug, Error)]
pub enum T5TokenizerError {
    /// The vocabulary (the shipped one, a `tokenizer.json`, GGUF metadata) is unusable.
    #[error("T5 vocabulary {source_name}: {detail}")]
    Vocabulary {
        /// Where it came from (a path, `built-in`, `GGUF metadata of PATH`).
        source_name: String,
        /// What is wrong.
        detail: String,
    },
    /// A text could not be encoded.
    #[error("T5 tokenizer: {0}")]
    Encode(String),
}

fn vocab_err(source: &str, detail: impl std::fmt::Display) -> T5TokenizerError {
    T5TokenizerError::Vocabulary {
        source_name: source.to_string(),
        detail: detail.to_string(),
    }
}

/// A T5 SentencePiece-Unigram tokenizer.
#[derive(Clone)]
pub struct T5Tokenizer {
    inner: Tokenizer,
}

impl std::fmt::Debug for T5Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("T5Tokenizer")
            .field("vocab_size", &self.inner.get_vocab_size(true))
            .finish()
    }
}

impl T5Tokenizer {
    /// The tokenizer with the shipped T5 v1.1 vocabulary (decompressed and parsed: about
    /// 0.1 s; build it once).
    pub fn builtin() -> Result<Self, T5TokenizerError> {
        let mut json = Vec::with_capacity(2_500_000);
        flate2::read::GzDecoder::new(BUILTIN)
            .read_to_end(&mut json)
            .map_err(|e| vocab_err("built-in", e))?;
        Self::from_json(&json, "built-in")
    }

    /// A tokenizer from a `tokenizer.json` (transformers' `T5TokenizerFast` format).
    pub fn from_file(path: &Path) -> Result<Self, T5TokenizerError> {
        let name = path.display().to_string();
        let json = std::fs::read(path).map_err(|e| vocab_err(&name, e))?;
        Self::from_json(&json, &name)
    }

    fn from_json(json: &[u8], name: &str) -> Result<Self, T5TokenizerError> {
        let inner = Tokenizer::from_bytes(json).map_err(|e| vocab_err(name, e))?;
        let t = T5Tokenizer { inner };
        t.check(name)?;
        Ok(t)
    }

    /// The tokenizer a llama.cpp T5 GGUF describes in its metadata (`tokenizer.ggml.model`
    /// `t5`: `tokens`, `scores`, `token_type`, `precompiled_charsmap`); `Ok(None)` when the
    /// file has no T5 vocabulary. `path` names the file in errors.
    pub fn from_gguf(header: &GgufHeader, path: &Path) -> Result<Option<Self>, T5TokenizerError> {
        let name = format!("GGUF metadata of {}", path.display());
        let meta = &header.metadata;
        match meta.get("tokenizer.ggml.model").and_then(GgufValue::as_str) {
            Some("t5") => {}
            _ => return Ok(None),
        }
        let array = |key: &str| match meta.get(key) {
            Some(GgufValue::Array(a)) => Ok(a),
            _ => Err(vocab_err(&name, format!("no array `{key}`"))),
        };
        let GgufArray::String(tokens) = array("tokenizer.ggml.tokens")? else {
            return Err(vocab_err(
                &name,
                "`tokenizer.ggml.tokens` is not a string array",
            ));
        };
        let GgufArray::F32(scores) = array("tokenizer.ggml.scores")? else {
            return Err(vocab_err(
                &name,
                "`tokenizer.ggml.scores` is not an f32 array",
            ));
        };
        if scores.len() != tokens.len() {
            return Err(vocab_err(
                &name,
                format!("{} tokens but {} scores", tokens.len(), scores.len()),
            ));
        }
        let types: Vec<i64> = match meta.get("tokenizer.ggml.token_type") {
            Some(GgufValue::Array(GgufArray::I32(t))) => t.iter().map(|&v| v as i64).collect(),
            Some(GgufValue::Array(GgufArray::U32(t))) => t.iter().map(|&v| v as i64).collect(),
            _ => vec![1; tokens.len()],
        };
        // llama.cpp writes the charsmap as an 8-bit array; other writers use wider integers.
        let charsmap: Vec<u8> = match meta.get("tokenizer.ggml.precompiled_charsmap") {
            Some(GgufValue::Array(GgufArray::U8(b))) => b.clone(),
            Some(GgufValue::Array(GgufArray::I8(b))) => b.iter().map(|&v| v as u8).collect(),
            Some(GgufValue::Array(GgufArray::I32(b))) => b.iter().map(|&v| v as u8).collect(),
            Some(GgufValue::Array(GgufArray::U32(b))) => b.iter().map(|&v| v as u8).collect(),
            _ => return Err(vocab_err(&name, "no `tokenizer.ggml.precompiled_charsmap`")),
        };
        let unk = meta
            .get("tokenizer.ggml.unknown_token_id")
            .and_then(GgufValue::as_i64)
            .unwrap_or(T5_UNK as i64) as usize;
        let vocab: Vec<(String, f64)> = tokens
            .iter()
            .zip(scores)
            .map(|(t, &s)| (t.clone(), s as f64))
            .collect();
        let model = Unigram::from(vocab, Some(unk), false).map_err(|e| vocab_err(&name, e))?;
        let mut inner = Tokenizer::new(model);
        let precompiled = Precompiled::from(&charsmap).map_err(|e| vocab_err(&name, e))?;
        let spaces = Replace::new(ReplacePattern::Regex(" {2,}".into()), " ")
            .map_err(|e| vocab_err(&name, e))?;
        inner.with_normalizer(Some(Sequence::new(vec![precompiled.into(), spaces.into()])));
        inner.with_pre_tokenizer(Some(Metaspace::new('▁', PrependScheme::Always, true)));
        // Unknown (2), control (3) and user-defined (4) pieces are special tokens, as the
        // `added_tokens` of transformers' tokenizer.json.
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| (2..=4).contains(&t))
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        inner.add_special_tokens(&special);
        let t = T5Tokenizer { inner };
        t.check(&name)?;
        Ok(Some(t))
    }

    /// The special tokens sit where T5's do.
    fn check(&self, name: &str) -> Result<(), T5TokenizerError> {
        for (piece, id) in [("<pad>", T5_PAD), ("</s>", T5_EOS), ("<unk>", T5_UNK)] {
            if self.inner.token_to_id(piece) != Some(id as u32) {
                return Err(vocab_err(
                    name,
                    format!("`{piece}` is not token {id}: not a T5 vocabulary"),
                ));
            }
        }
        Ok(())
    }

    /// The number of pieces (special tokens included).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The ids of `text` followed by `</s>`, unpadded and untruncated (transformers'
    /// `tokenizer(text).input_ids`).
    pub fn encode(&self, text: &str) -> Result<Vec<i32>, T5TokenizerError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| T5TokenizerError::Encode(e.to_string()))?;
        let mut ids: Vec<i32> = enc.get_ids().iter().map(|&i| i as i32).collect();
        ids.push(T5_EOS);
        Ok(ids)
    }

    /// The ids as the FLUX and SD3 pipelines pass them to the encoder: at most
    /// `max_len - 1` prompt tokens, `</s>`, then `<pad>` up to `max_len` (transformers'
    /// `tokenizer(text, padding="max_length", max_length=max_len, truncation=True)`).
    pub fn encode_padded(&self, text: &str, max_len: usize) -> Result<Vec<i32>, T5TokenizerError> {
        if max_len == 0 {
            return Err(T5TokenizerError::Encode(
                "a maximum length of 0 tokens".into(),
            ));
        }
        let mut ids = self.encode(text)?;
        ids.pop();
        ids.truncate(max_len - 1);
        ids.push(T5_EOS);
        ids.resize(max_len, T5_PAD);
        Ok(ids)
    }
}

/// Where a T5 vocabulary is taken from: the shipped one unless the user gives a
/// `tokenizer.json` or the T5 file is a GGUF with its own.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum T5Vocabulary {
    /// The shipped T5 v1.1 vocabulary.
    #[default]
    Builtin,
    /// A `tokenizer.json`.
    File(PathBuf),
}

impl T5Vocabulary {
    /// Builds the tokenizer.
    pub fn load(&self) -> Result<T5Tokenizer, T5TokenizerError> {
        match self {
            T5Vocabulary::Builtin => T5Tokenizer::builtin(),
            T5Vocabulary::File(p) => T5Tokenizer::from_file(p),
        }
    }
}
