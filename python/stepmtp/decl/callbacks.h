/* Python functions llama.cpp calls back into (cffi "extern Python"). */

extern "Python" void stepmtp_log_cb(enum ggml_log_level level, const char * text, void * user_data);
extern "Python" bool stepmtp_progress_cb(float progress, void * user_data);
