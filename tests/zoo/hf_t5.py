"""T5 (transformers): encoder-decoder whose embedding is shared four ways.

``shared``, the encoder's and the decoder's ``embed_tokens`` are one weight, and
the LM head is tied to it too (``tie_word_embeddings``). A small configuration,
random weights, nothing downloaded.
"""

from __future__ import annotations

import hf_common
import torchvision_cpu  # noqa: F401  (transformers imports torchvision when it is installed)
from transformers import T5Config, T5ForConditionalGeneration

BATCH_SIZE = 8


def build_model():
    config = T5Config(
        vocab_size=hf_common.VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        use_cache=False,  # training: no key/value cache in the outputs
        tie_word_embeddings=True,
        decoder_start_token_id=0,
    )
    return T5ForConditionalGeneration(config)


def sample_batch(batch_size):
    source, _ = hf_common.token_batch(batch_size)
    target, labels = hf_common.token_batch(batch_size, seq=16)
    return {"input_ids": source, "decoder_input_ids": target}, labels


loss_fn = hf_common.causal_lm_loss
