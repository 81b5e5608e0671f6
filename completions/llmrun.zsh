#compdef llmrun

_llmrun_completion() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _LLMRUN_COMPLETE=complete_zsh llmrun)
}

compdef _llmrun_completion llmrun
