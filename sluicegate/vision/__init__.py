"""The vision layer shared by the edge agent and the center pool workers.

    image       probe a JPEG/PNG header (decompression-bomb guard), decode with OpenCV
    manifest    the model manifest (pydantic): input, preprocessing, labels, postprocessing
    geometry    where an image sits in the model input (stretch, letterbox), and back
    preprocess  decoded image -> float32 NCHW tensor, exactly as the manifest says
    postprocess raw output tensors -> labelled Outputs (classification, detection, anomaly)
    detection   detector outputs in the exporters' layouts, NMS, boxes on the image
    anomaly     anomaly-score maps -> regions and the image's verdict
    runtime     ModelRegistry / LoadedModel: verified ONNX Runtime sessions, infer_bytes
    graph       what a brought ONNX graph declares (needs the onnx package)
    author      a manifest for a brought graph, or why it fits no kind (pure)
    adding      ``models add``: check, run once, install
    synth       synthetic industrial surface images with defects, for training and demos
    synth_boxes the same surfaces with boxed defects, for the detector
    label_synth synthetic part labels with serial numbers, for OCR
    metrics     mAP@0.5 of detections against boxed truth
    priors      service-time priors measured per node (``models bench``)
    watch       the models folder watched: a new version served without a restart
    openvino_session  Intel's OpenVINO as a second backend

Nothing here does I/O other than reading model files, and nothing here is async: callers run
it in their own executor. Import the submodules directly; this package imports none of them,
so ``import sluicegate.vision.synth`` does not load ONNX Runtime.
"""
