"""What tests share: real daemons on loopback (`daemons`), the admin API fixture server
(`admin_fixture`), and the fakes at the hardware boundary, each following the real API
(`fake_nvml`, `fake_tensorrt_llm`, `fake_flashinfer`). Imported as `helpers.<module>`:
`tests/` is on the path (pyproject's `pythonpath`)."""
