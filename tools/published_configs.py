"""The published configs of the models whose sizes this project states without their weights (the Hub is not
reachable from its machines, so each was read from a public copy of the file: see each entry), as plain data:
`tools.model_bytes` weighs them, `bench/transformer.py` builds their transformers at the real widths."""

# Qwen/Qwen3-4B config.json (36 layers of 2560, 32 query and 8 key/value heads of 128, SwiGLU 9728, tied embedding)
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# Qwen/Qwen3-8B config.json (FLUX.2 [klein] 9B's text encoder): 4096 wide, SwiGLU 12288, its own lm_head (not read)
QWEN3_8B = {**QWEN3_4B, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False}
# FLUX.1's VAE (Z-Image's vae/config.json): 16 latent channels, no quant convolutions
FLUX1_VAE = {
    "_class_name": "AutoencoderKL",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "latent_channels": 16,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
# FLUX.2's VAE (every [klein] folder's vae/config.json): 32 latent channels, quant convolutions, a batch norm
FLUX2_VAE = {
    "_class_name": "AutoencoderKLFlux2",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "latent_channels": 32,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "batch_norm_eps": 0.0001,
    "batch_norm_momentum": 0.1,
    "patch_size": [2, 2],
    "use_quant_conv": True,
    "use_post_quant_conv": True,
}
# FLUX.2-klein-4B transformer/config.json as diffusers' scripts/convert_flux2_to_diffusers.py writes it (`klein-4b`)
KLEIN_4B = {
    "_class_name": "Flux2Transformer2DModel",
    "patch_size": 1,
    "in_channels": 128,
    "num_layers": 5,
    "num_single_layers": 20,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 7680,
    "timestep_guidance_channels": 256,
    "mlp_ratio": 3.0,
    "axes_dims_rope": [32, 32, 32, 32],
    "rope_theta": 2000,
    "eps": 1e-6,
    "guidance_embeds": False,
}
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000}
PUBLISHED = {
    # Tongyi-MAI/Z-Image-Turbo: transformer/config.json as ComfyUI's and ai-toolkit's Z-Image plugins copy it
    "Tongyi-MAI/Z-Image-Turbo": {
        "model_index.json": {"_class_name": "ZImagePipeline"},
        "transformer": {
            "_class_name": "ZImageTransformer2DModel",
            "all_patch_size": [2],
            "all_f_patch_size": [1],
            "in_channels": 16,
            "dim": 3840,
            "n_layers": 30,
            "n_refiner_layers": 2,
            "n_heads": 30,
            "n_kv_heads": 30,
            "norm_eps": 1e-5,
            "qk_norm": True,
            "cap_feat_dim": 2560,
            "rope_theta": 256.0,
            "t_scale": 1000.0,
            "axes_dims": [32, 48, 48],
            "axes_lens": [1536, 512, 512],
        },
        "text_encoder": QWEN3_4B,
        "vae": FLUX1_VAE,
        "scheduler": {**SCHEDULER, "shift": 3.0, "use_dynamic_shifting": False},
    },
    "black-forest-labs/FLUX.2-klein-4B": {
        "model_index.json": {"_class_name": "Flux2KleinPipeline", "is_distilled": True},
        "transformer": KLEIN_4B,
        "text_encoder": QWEN3_4B,
        "vae": FLUX2_VAE,
        "scheduler": {**SCHEDULER, "shift": 3.0, "use_dynamic_shifting": True},
    },
    # 9B: 8 double and 24 single blocks of 32 heads, reading Qwen3-8B's layers (3 x 4096 wide)
    "black-forest-labs/FLUX.2-klein-9B": {
        "model_index.json": {"_class_name": "Flux2KleinPipeline", "is_distilled": True},
        "transformer": {
            **KLEIN_4B,
            "num_layers": 8,
            "num_single_layers": 24,
            "num_attention_heads": 32,
            "joint_attention_dim": 12288,
        },
        "text_encoder": QWEN3_8B,
        "vae": FLUX2_VAE,
        "scheduler": {**SCHEDULER, "shift": 3.0, "use_dynamic_shifting": True},
    },
}
