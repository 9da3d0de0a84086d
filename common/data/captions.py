"""Caption shards as both sides see them: what data.prepare_captions records in meta.json (its source, the images it
skipped by reason) and the one-line summary of the skips that the builder prints and a text-to-image run quotes."""

from __future__ import annotations

SOURCE = "captioned_images"  # meta.json "source" of data.prepare_captions' shards: what the text-to-image recipe reads
SKIP_REASONS = ("undecodable", "no_caption", "empty_caption")  # meta.json "skipped": {reason: file names}
_WORDS = {
    "undecodable": "undecodable",
    "no_caption": "without a caption",
    "empty_caption": "with an empty caption",
    "too_short": "too short",  # a video clip shorter than the frames asked (data.prepare_videos)
}


def skip_summary(meta: dict) -> str:
    """ "skipped 3 file(s): 1 undecodable (broken.png), 1 without a caption (...), ..." from meta.json."""
    parts = [
        f"{len(files)} {_WORDS[reason]} ({', '.join(files[:3])}{' ...' if len(files) > 3 else ''})"
        for reason, files in meta["skipped"].items()
        if files
    ]
    return f"skipped {sum(map(len, meta['skipped'].values()))} file(s)" + (f": {'; '.join(parts)}" if parts else "")
