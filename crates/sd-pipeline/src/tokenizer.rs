//! CLIP BPE tokenization and the 77-token chunking of Stable Diffusion prompts.
//!
//! Byte-pair encoding uses the OpenAI CLIP vocabulary (`bpe_simple_vocab_16e6.txt`, shipped by
//! the `instant-clip-tokenizer` crate), so token ids equal those of open_clip's
//! `SimpleTokenizer` and transformers' `CLIPTokenizer`. Text is lowercased (Unicode) and split
//! the CLIP way (`'s|'t|'re|'ve|'m|'ll|'d|\p{L}+|\p{N}|[^\s\p{L}\p{N}]+`); the literal strings
//! `<|startoftext|>` and `<|endoftext|>` become the special tokens, as in transformers and
//! stable-diffusion.cpp. The `ftfy`/HTML-entity clean-up of the Python tokenizers is not
//! applied (stable-diffusion.cpp does not apply it either).
//!
//! Prompts are tokenized as stable-diffusion.cpp does for SD1/SD2/SDXL: the attention syntax is
//! parsed ([`crate::prompt`]), each piece is encoded on its own, `BREAK` pads the running token
//! list with EOS up to a multiple of 75, and the list is cut into chunks of 75 tokens, each
//! wrapped as `[BOS, ..75 tokens.., EOS, PAD..]` to [`CHUNK_LEN`] = 77 tokens.

use instant_clip_tokenizer::{Token, Tokenizer};

use crate::prompt::{parse_prompt_attention, PromptPart};

/// Start-of-text token id.
pub const BOS_TOKEN: i32 = 49406;
/// End-of-text token id (also the SD1/SDXL padding token).
pub const EOS_TOKEN: i32 = 49407;
/// Tokens per encoder call, BOS and EOS included.
pub const CHUNK_LEN: usize = 77;
/// Prompt tokens per chunk (`CHUNK_LEN` less BOS and EOS).
pub const TOKENS_PER_CHUNK: usize = CHUNK_LEN - 2;

const SOT_TEXT: &str = "<|startoftext|>";
const EOT_TEXT: &str = "<|endoftext|>";

/// Which token fills a chunk after its EOS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Padding {
    /// Pad with EOS (49407): SD1.x, SDXL, the OpenAI CLIP text encoders.
    Eos,
    /// Pad with 0: SD2.x's OpenCLIP ViT-H text encoder (stable-diffusion.cpp uses 0 there).
    Zero,
}

impl Padding {
    /// The padding token id.
    pub fn token(self) -> i32 {
        match self {
            Padding::Eos => EOS_TOKEN,
            Padding::Zero => 0,
        }
    }
}

/// A CLIP BPE tokenizer with Stable Diffusion's chunking and padding rules.
///
/// Construction parses the vocabulary (tens of milliseconds): build it once and reuse it.
pub struct ClipTokenizer {
    bpe: Tokenizer,
    padding: Padding,
}

impl std::fmt::Debug for ClipTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClipTokenizer")
            .field("padding", &self.padding)
            .finish_non_exhaustive()
    }
}

impl ClipTokenizer {
    /// A tokenizer with the bundled OpenAI CLIP vocabulary and the given padding.
    pub fn new(padding: Padding) -> Self {
        ClipTokenizer {
            bpe: Tokenizer::new(),
            padding,
        }
    }

    /// The tokenizer of SD1.x and SDXL (padding with EOS).
    pub fn sd1() -> Self {
        Self::new(Padding::Eos)
    }

    /// The tokenizer of SD2.x (OpenCLIP, padding with 0).
    pub fn sd2() -> Self {
        Self::new(Padding::Zero)
    }

    /// The padding rule.
    pub fn padding(&self) -> Padding {
        self.padding
    }

    /// BPE token ids of `text`, without BOS/EOS and without any attention parsing.
    pub fn encode(&self, text: &str) -> Vec<i32> {
        let mut out = Vec::new();
        let mut rest = text;
        // Special-token literals, found case-insensitively as the text is lowercased anyway.
        while let Some((pos, len, id)) = find_special(rest) {
            self.encode_plain(&rest[..pos], &mut out);
            out.push(id);
            rest = &rest[pos + len..];
        }
        self.encode_plain(rest, &mut out);
        out
    }

    /// Encodes text holding no special-token literal. The crate treats `<start_of_text>` and
    /// `<end_of_text>` as its own markers; CLIP's reference tokenizers do not, so such text is
    /// split just before its closing `>` (a split point of the CLIP regex anyway, since `>`
    /// follows a letter).
    fn encode_plain(&self, text: &str, out: &mut Vec<i32>) {
        let mut tokens: Vec<Token> = Vec::new();
        let mut rest = text;
        while let Some(pos) = find_crate_marker(rest) {
            self.bpe.encode(&rest[..pos], &mut tokens);
            rest = &rest[pos..];
        }
        self.bpe.encode(rest, &mut tokens);
        out.extend(tokens.into_iter().map(|t| i32::from(t.to_u16())));
    }

    /// Decodes token ids back to text (lossy: word ends become spaces); unknown ids are skipped.
    pub fn decode(&self, tokens: &[i32]) -> String {
        let mut text = String::new();
        let mut run: Vec<Token> = Vec::new();
        let flush = |run: &mut Vec<Token>, text: &mut String| {
            if !run.is_empty() {
                text.push_str(&self.bpe.decode(run.drain(..)));
            }
        };
        for &id in tokens {
            match id {
                BOS_TOKEN => {
                    flush(&mut run, &mut text);
                    text.push_str(SOT_TEXT);
                }
                EOS_TOKEN => {
                    flush(&mut run, &mut text);
                    text.push_str(EOT_TEXT);
                }
                _ => {
                    if let Some(t) = u16::try_from(id)
                        .ok()
                        .and_then(|v| Token::from_u16(v, &self.bpe))
                    {
                        run.push(t);
                    }
                }
            }
        }
        flush(&mut run, &mut text);
        text
    }

    /// Tokenizes a prompt with attention syntax into 77-token chunks with per-token weights.
    pub fn tokenize_weighted(&self, prompt: &str) -> WeightedTokens {
        self.tokenize_parts(&parse_prompt_attention(prompt))
    }

    /// Tokenizes a prompt literally (no attention syntax) into 77-token chunks, weights 1.
    pub fn tokenize(&self, text: &str) -> WeightedTokens {
        self.tokenize_parts(&[PromptPart::text(text, 1.0)])
    }

    /// Tokenizes parsed prompt parts into 77-token chunks with per-token weights.
    ///
    /// Always returns at least one chunk (an empty prompt gives `[BOS, EOS, PAD × 75]`).
    pub fn tokenize_parts(&self, parts: &[PromptPart]) -> WeightedTokens {
        let mut tokens: Vec<i32> = Vec::new();
        let mut weights: Vec<f32> = Vec::new();
        for part in parts {
            match part {
                PromptPart::Break => {
                    let pad =
                        (TOKENS_PER_CHUNK - tokens.len() % TOKENS_PER_CHUNK) % TOKENS_PER_CHUNK;
                    tokens.extend(std::iter::repeat_n(EOS_TOKEN, pad));
                    weights.extend(std::iter::repeat_n(1.0, pad));
                }
                PromptPart::Text { text, weight } => {
                    let ids = self.encode(text);
                    weights.extend(std::iter::repeat_n(*weight, ids.len()));
                    tokens.extend(ids);
                }
            }
        }
        self.chunk(&tokens, &weights)
    }

    /// Wraps a raw token list (no BOS/EOS) into 77-token chunks.
    fn chunk(&self, tokens: &[i32], weights: &[f32]) -> WeightedTokens {
        let mut out = WeightedTokens {
            tokens: Vec::new(),
            weights: Vec::new(),
            pad_token: self.padding.token(),
        };
        if tokens.is_empty() {
            out.push_chunk(&[], &[]);
        }
        for (t, w) in tokens
            .chunks(TOKENS_PER_CHUNK)
            .zip(weights.chunks(TOKENS_PER_CHUNK))
        {
            out.push_chunk(t, w);
        }
        out
    }
}

impl Default for ClipTokenizer {
    fn default() -> Self {
        Self::sd1()
    }
}

/// Finds the first `<|startoftext|>` / `<|endoftext|>` (ASCII case-insensitive): position,
/// byte length and token id.
fn find_special(s: &str) -> Option<(usize, usize, i32)> {
    let lower = s.to_ascii_lowercase();
    let sot = lower.find(SOT_TEXT).map(|p| (p, SOT_TEXT.len(), BOS_TOKEN));
    let eot = lower.find(EOT_TEXT).map(|p| (p, EOT_TEXT.len(), EOS_TOKEN));
    match (sot, eot) {
        (Some(a), Some(b)) => Some(if a.0 < b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// Position of the `>` of the first `<start_of_text>` / `<end_of_text>` (case-insensitive).
fn find_crate_marker(s: &str) -> Option<usize> {
    let lower = s.to_ascii_lowercase();
    ["<start_of_text>", "<end_of_text>"]
        .iter()
        .filter_map(|m| lower.find(m).map(|p| p + m.len() - 1))
        .min()
}

/// A tokenized prompt: `n × 77` token ids with one attention weight each.
///
/// Chunk `i` is `tokens[77 i .. 77 (i + 1)]`, laid out `[BOS, prompt tokens, EOS, PAD..]`;
/// BOS, EOS and padding have weight 1.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightedTokens {
    tokens: Vec<i32>,
    weights: Vec<f32>,
    pad_token: i32,
}

impl WeightedTokens {
    fn push_chunk(&mut self, tokens: &[i32], weights: &[f32]) {
        let pad = TOKENS_PER_CHUNK.saturating_sub(tokens.len());
        self.tokens.push(BOS_TOKEN);
        self.tokens.extend_from_slice(tokens);
        self.tokens.push(EOS_TOKEN);
        self.tokens.extend(std::iter::repeat_n(self.pad_token, pad));
        self.weights.push(1.0);
        self.weights.extend_from_slice(weights);
        self.weights.push(1.0);
        self.weights.extend(std::iter::repeat_n(1.0, pad));
    }

    /// All token ids, chunk after chunk.
    pub fn tokens(&self) -> &[i32] {
        &self.tokens
    }

    /// All weights, aligned with [`tokens`](Self::tokens).
    pub fn weights(&self) -> &[f32] {
        &self.weights
    }

    /// The padding token used.
    pub fn pad_token(&self) -> i32 {
        self.pad_token
    }

    /// Number of 77-token chunks (at least 1).
    pub fn num_chunks(&self) -> usize {
        self.tokens.len() / CHUNK_LEN
    }

    /// The chunks: 77 token ids and 77 weights each.
    pub fn chunks(&self) -> impl ExactSizeIterator<Item = (&[i32], &[f32])> + '_ {
        self.tokens
            .chunks(CHUNK_LEN)
            .zip(self.weights.chunks(CHUNK_LEN))
    }

    /// Appends empty chunks (`[BOS, EOS, PAD × 75]`, weights 1) up to `n` chunks; used to give
    /// the prompt and the negative prompt the same length for batched classifier-free guidance.
    pub fn pad_to_chunks(&mut self, n: usize) {
        while self.num_chunks() < n {
            self.push_chunk(&[], &[]);
        }
    }

    /// Keeps the first `n` chunks (at least one): the truncation of encoders that read a
    /// single 77-token window (diffusers' `truncation=True`, SD3).
    pub fn truncate_to_chunks(&mut self, n: usize) {
        let keep = n.max(1) * CHUNK_LEN;
        self.tokens.truncate(keep);
        self.weights.truncate(keep);
    }

    /// Whether every weight is 1 (weighting is then skipped).
    pub fn is_unweighted(&self) -> bool {
        self.weights.iter().all(|&w| w == 1.0)
    }
}

/// The token ids SDXL's second (OpenCLIP bigG) encoder gets for a chunk: everything after the
/// first EOS is set to 0, as stable-diffusion.cpp does.
pub fn zero_after_eos(chunk: &[i32]) -> Vec<i32> {
    let mut out = chunk.to_vec();
    if let Some(p) = out.iter().position(|&t| t == EOS_TOKEN) {
        out[p + 1..].fill(0);
    }
    out
}

/// Index of the first EOS of a chunk (the token whose hidden state is pooled), or the last
/// index when there is none.
pub fn eos_index(chunk: &[i32]) -> usize {
    chunk
        .iter()
        .position(|&t| t == EOS_TOKEN)
        .unwrap_or(chunk.len().saturating_sub(1))
}
