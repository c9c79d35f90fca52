//! The Qwen2 tokenizer (byte-level BPE) of Qwen-Image's Qwen2.5-VL text encoder, and the
//! Qwen-Image prompt template.
//!
//! Tokenization is the `tokenizers` crate's, built as pure Rust (`default-features = false,
//! features = ["fancy-regex"]`), set up as transformers' `Qwen2Tokenizer` (`Qwen2TokenizerFast`)
//! sets up its backend, so ids equal transformers': NFC normalization; the text split by
//! Qwen2's pattern [`QWEN2_SPLIT`] (contractions, letter runs with one leading non-letter,
//! single digits, punctuation runs, newlines, spaces; the split pieces kept); each piece as
//! bytes mapped to GPT-2's printable characters (no prefix space); BPE merges by rank; the
//! special tokens (`<|endoftext|>` 151643, `<|im_start|>` 151644, `<|im_end|>` 151645, ...)
//! matched in the text before all that. No token is added around the text.
//!
//! # The vocabulary
//!
//! No checkpoint carries it and sd-rs runs without a model hub, so the Qwen2 merges ship with
//! sd-rs: `assets/qwen2_merges.txt.gz`, the 151 387 merges of Qwen2's `merges.txt` (the same
//! for Qwen2.5, Qwen2.5-VL and Qwen3), one `left right` pair per line without a version
//! header, gzip'd (688 KiB). The vocabulary is rebuilt from them as
//! stable-diffusion.cpp's `qwen2_tokenizer.cpp` does, which gives Qwen2's `vocab.json`: ids
//! 0..255 the 256 byte characters in GPT-2's `bytes_to_unicode` order, then one token per
//! merge (the concatenated pair) in merge order, then the special tokens [`QWEN2_SPECIAL`]
//! from 151643. Source: stable-diffusion.cpp's generated header
//! `src/tokenizers/vocab/qwen.hpp` (array `qwen2_merges_utf8_c_str`), as vendored in the
//! `stable-diffusion-cpp-python` 0.4.7 source distribution on PyPI, extracted byte for byte.
//! License: the Qwen2 vocabulary is Alibaba Cloud's Qwen team's, Apache-2.0 (the Qwen2 /
//! Qwen2.5 repositories); stable-diffusion.cpp, which embeds it, is MIT. See
//! `assets/README.md`.
//!
//! # The Qwen-Image template
//!
//! Qwen-Image encodes a prompt wrapped in a chat template ([`QWEN_IMAGE_TEMPLATE`]) and drops
//! the hidden states of the template's leading system/user part (34 tokens;
//! diffusers `QwenImagePipeline.prompt_template_encode_start_idx`, stable-diffusion.cpp the
//! same). [`QwenTokenizer::encode_template`] tokenizes the whole wrapped text as diffusers
//! does, truncated at 1024 prompt tokens plus the dropped ones, and gives the drop count,
//! computed from the tokenized prefix.

use std::io::Read;

use thiserror::Error;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// Qwen2's pre-tokenization pattern (its `tokenizer.json`'s `Split` regex).
pub const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The special tokens after the merges, in id order from [`QWEN2_ENDOFTEXT`] (Qwen2.5's up
/// to `<|file_sep|>` 151664, then Qwen3's four; stable-diffusion.cpp's list).
pub const QWEN2_SPECIAL: [&str; 26] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
];

/// `<|endoftext|>`: the first special token (also Qwen2's padding token).
pub const QWEN2_ENDOFTEXT: i32 = 151643;
/// `<|im_start|>`.
pub const QWEN2_IM_START: i32 = 151644;
/// `<|im_end|>`.
pub const QWEN2_IM_END: i32 = 151645;
/// Merges in Qwen2's `merges.txt`.
pub const QWEN2_MERGES: usize = 151_387;

/// The most prompt tokens Qwen-Image passes after the template's dropped prefix (diffusers
/// `QwenImagePipeline.tokenizer_max_length`).
pub const QWEN_IMAGE_MAX_PROMPT_TOKENS: usize = 1024;

/// A chat template around a prompt: `prefix`, the prompt, `suffix`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptTemplate {
    /// The text before the prompt.
    pub prefix: &'static str,
    /// The text after the prompt.
    pub suffix: &'static str,
}

/// Qwen-Image's text-to-image template (diffusers `QwenImagePipeline.prompt_template_encode`;
/// stable-diffusion.cpp the same).
pub const QWEN_IMAGE_TEMPLATE: PromptTemplate = PromptTemplate {
    prefix: "<|im_start|>system\nDescribe the image by detailing the color, shape, size, \
             texture, quantity, text, spatial relationships of the objects and background:\
             <|im_end|>\n<|im_start|>user\n",
    suffix: "<|im_end|>\n<|im_start|>assistant\n",
};

/// Template-wrapped ids and how many leading hidden states to drop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TemplatedIds {
    /// The ids of prefix, prompt and suffix tokenized as one text.
    pub ids: Vec<i32>,
    /// The number of leading positions that belong to the template's prefix (34 for
    /// [`QWEN_IMAGE_TEMPLATE`]); the encoder's hidden states there are dropped.
    pub drop: usize,
}

/// The shipped Qwen2 merges, gzip'd.
static BUILTIN: &[u8] = include_bytes!("../assets/qwen2_merges.txt.gz");

/// Why a Qwen2 tokenizer could not be built or could not encode.
#[derive(Debug, Error)]
pub enum QwenTokenizerError {
    /// The merges (the shipped ones, or given ones) are unusable.
    #[error("Qwen2 vocabulary {source_name}: {detail}")]
    Vocabulary {
        /// Where it came from (`built-in`, a path).
        source_name: String,
        /// What is wrong.
        detail: String,
    },
    /// A text could not be encoded.
    #[error("Qwen2 tokenizer: {0}")]
    Encode(String),
}

fn vocab_err(source: &str, detail: impl std::fmt::Display) -> QwenTokenizerError {
    QwenTokenizerError::Vocabulary {
        source_name: source.to_string(),
        detail: detail.to_string(),
    }
}

/// GPT-2's byte-to-character map in its order: the printable bytes `!`..`~`, `¡`..`¬`,
/// `®`..`ÿ` as themselves, then every other byte, ascending, as U+0100 onwards. Position `i`
/// holds the character of token id `i`.
pub fn bytes_to_unicode() -> Vec<(u8, char)> {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut out: Vec<(u8, char)> = (0..=255u8)
        .filter(|&b| printable(b))
        .map(|b| (b, char::from(b)))
        .collect();
    for (n, b) in (0..=255u8).filter(|&b| !printable(b)).enumerate() {
        // U+0100..U+0143: valid scalar values.
        out.push((b, char::from_u32(256 + n as u32).unwrap_or('\u{FFFD}')));
    }
    out
}

/// A Qwen2 byte-level BPE tokenizer.
#[derive(Clone)]
pub struct QwenTokenizer {
    inner: Tokenizer,
}

impl std::fmt::Debug for QwenTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QwenTokenizer")
            .field("vocab_size", &self.inner.get_vocab_size(true))
            .finish()
    }
}

impl QwenTokenizer {
    /// The tokenizer with the shipped Qwen2 merges (decompressed and built: a fraction of a
    /// second; build it once).
    pub fn builtin() -> Result<Self, QwenTokenizerError> {
        let mut text = String::with_capacity(1_700_000);
        flate2::read::GzDecoder::new(BUILTIN)
            .read_to_string(&mut text)
            .map_err(|e| vocab_err("built-in", e))?;
        Self::from_merges(&text, "built-in")
    }

    /// A tokenizer from the text of a Qwen2 `merges.txt` (an optional `#version` first line,
    /// then one `left right` pair per line; the vocabulary is rebuilt from the merges, see the
    /// module documentation). `name` names the source in errors.
    pub fn from_merges(text: &str, name: &str) -> Result<Self, QwenTokenizerError> {
        let mut lines = text.lines().peekable();
        if lines.peek().is_some_and(|l| l.starts_with("#version")) {
            lines.next();
        }
        let mut merges = Vec::with_capacity(QWEN2_MERGES);
        for (i, line) in lines.filter(|l| !l.is_empty()).enumerate() {
            let Some((a, b)) = line.split_once(' ') else {
                return Err(vocab_err(name, format!("merge {i} `{line}` is not a pair")));
            };
            merges.push((a.to_string(), b.to_string()));
        }
        if merges.len() != QWEN2_MERGES {
            return Err(vocab_err(
                name,
                format!("{} merges, Qwen2 has {QWEN2_MERGES}", merges.len()),
            ));
        }
        let mut vocab: tokenizers::models::bpe::Vocab = Default::default();
        for (_, c) in bytes_to_unicode() {
            let id = vocab.len() as u32;
            vocab.insert(c.to_string(), id);
        }
        for (a, b) in &merges {
            let id = vocab.len() as u32;
            if vocab.insert(format!("{a}{b}"), id).is_some() {
                return Err(vocab_err(name, format!("merge `{a} {b}` repeats a token")));
            }
        }
        let model = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| vocab_err(name, e))?;
        let mut inner = Tokenizer::new(model);
        inner.with_normalizer(Some(NFC));
        let split = Split::new(
            SplitPattern::Regex(QWEN2_SPLIT.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| vocab_err(name, e))?;
        let byte_level = ByteLevel::new(false, false, false);
        inner.with_pre_tokenizer(Some(Sequence::new(vec![split.into(), byte_level.into()])));
        inner.with_decoder(Some(ByteLevel::default()));
        let special: Vec<AddedToken> = QWEN2_SPECIAL
            .iter()
            .map(|s| AddedToken::from(*s, true))
            .collect();
        inner.add_special_tokens(&special);
        let t = QwenTokenizer { inner };
        for (i, s) in QWEN2_SPECIAL.iter().enumerate() {
            if t.inner.token_to_id(s) != Some(QWEN2_ENDOFTEXT as u32 + i as u32) {
                return Err(vocab_err(
                    name,
                    format!("`{s}` is not token {}", 151643 + i),
                ));
            }
        }
        Ok(t)
    }

    /// The number of tokens (special tokens included: 151 669).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The ids of `text`, nothing added (transformers' `tokenizer(text).input_ids`); special
    /// tokens written in the text are matched.
    pub fn encode(&self, text: &str) -> Result<Vec<i32>, QwenTokenizerError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| QwenTokenizerError::Encode(e.to_string()))?;
        Ok(enc.get_ids().iter().map(|&i| i as i32).collect())
    }

    /// The text of `ids` (special tokens included).
    pub fn decode(&self, ids: &[i32]) -> Result<String, QwenTokenizerError> {
        let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        self.inner
            .decode(&ids, false)
            .map_err(|e| QwenTokenizerError::Encode(e.to_string()))
    }

    /// `prompt` wrapped in `template`, tokenized as one text and truncated to `drop +
    /// max_prompt_tokens` ids, with `drop` the token count of the template's prefix alone
    /// (diffusers' `QwenImagePipeline._get_qwen_prompt_embeds` with `max_prompt_tokens`
    /// [`QWEN_IMAGE_MAX_PROMPT_TOKENS`]: `tokenizer(template.format(prompt),
    /// max_length=1024 + 34, truncation=True)`, the first 34 hidden states dropped).
    pub fn encode_template(
        &self,
        template: &PromptTemplate,
        prompt: &str,
        max_prompt_tokens: usize,
    ) -> Result<TemplatedIds, QwenTokenizerError> {
        let drop = self.encode(template.prefix)?.len();
        let mut ids = self.encode(&format!("{}{prompt}{}", template.prefix, template.suffix))?;
        ids.truncate(drop + max_prompt_tokens);
        Ok(TemplatedIds { ids, drop })
    }

    /// `prompt` in [`QWEN_IMAGE_TEMPLATE`], at most [`QWEN_IMAGE_MAX_PROMPT_TOKENS`] after the
    /// dropped prefix (see [`QwenTokenizer::encode_template`]).
    pub fn encode_qwen_image(&self, prompt: &str) -> Result<TemplatedIds, QwenTokenizerError> {
        self.encode_template(&QWEN_IMAGE_TEMPLATE, prompt, QWEN_IMAGE_MAX_PROMPT_TOKENS)
    }
}

#[cfg(test)]
mod tests {
    use super::bytes_to_unicode;

    #[test]
    fn byte_characters_follow_gpt2_order() {
        let map = bytes_to_unicode();
        assert_eq!(map.len(), 256);
        assert_eq!(map[0], (b'!', '!'));
        // Space and newline are the 33rd and 11th non-printable bytes: ids 220 and 198.
        assert_eq!(map[220], (b' ', 'Ġ'));
        assert_eq!(map[198], (b'\n', 'Ċ'));
        let mut bytes: Vec<u8> = map.iter().map(|&(b, _)| b).collect();
        bytes.sort_unstable();
        assert!(bytes.iter().enumerate().all(|(i, &b)| b as usize == i));
    }
}
