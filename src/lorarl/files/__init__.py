"""What lorarl writes to disk and reads back.

checkpoint  every checkpoint file, written atomically; what a resume reads
peft_io     standard PEFT adapter folders and LoRA configs
jsonio      JSON files written atomically, read tolerantly
"""
