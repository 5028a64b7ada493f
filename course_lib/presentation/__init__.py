"""What the notebooks show around the ideas: static plots, interactive (plotly) figures, the ipywidgets
explorers, predictions the learner commits to, the "your turn" checkers with their reference answers, and
the labs' results. The ideas themselves live one level up, in course_lib."""
