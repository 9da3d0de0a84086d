"""The diffusion core that the class-conditional DiT (recipes/dit) and text-to-image (recipes/t2i) recipes share: the
`diffusion` config section, the objectives (DDPM, rectified flow), the VAE latent path, the sampler and the image
conversions. A recipe never imports another recipe; what two diffusion families share lives here."""
