"""Video files for the VLM tests: frames in, a lossless MP4 or Matroska file's bytes out."""

from __future__ import annotations


def encode_video(frames, fps: int, container: str = "mp4") -> bytes:
    """[N, H, W, 3] uint8 RGB frames as a video file's bytes, losslessly (PyAV): an MP4 of H.264 in RGB (libx264rgb
    at qp 0; the container records its frame count) or a Matroska of FFV1 (``container="mkv"``: no frame count, as
    WebM and MKV files often have none). Decoding gives the frames back bit for bit."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4" if container == "mp4" else "matroska") as out:
        codec, pix_fmt = ("libx264rgb", "rgb24") if container == "mp4" else ("ffv1", "bgr0")
        stream = out.add_stream(codec, rate=fps)
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], pix_fmt
        if codec == "libx264rgb":
            stream.options = {"qp": "0"}
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()
